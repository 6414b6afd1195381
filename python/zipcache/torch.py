"""zipcache for PyTorch: zero-copy tensors, a transformers cache, GPU loads.

    import zipcache, zipcache.torch as zt
    k, v = zt.layer_tensors(session, 0)          # CPU tensors over the mapping, no copy
    cache = zt.SessionCache(session, device="cuda")
    model.generate(ids, past_key_values=cache)    # transformers, when installed

Only this module imports torch; ``import zipcache`` never does.

Zero copy and read-only. ``layer_tensors`` wraps the read-only numpy
views of the session's mapping (zipcache.client) with ``torch.from_numpy``:
the tensors share memory with the mapping. torch has no read-only
tensors, so torch warns about it ("The given NumPy array is not
writable"); this module silences exactly that warning because the answer
is known: the pages are mapped PROT_READ, and an in-place write through
such a tensor (``k.add_(1)``, ``k[0] = 0``, an ``out=`` argument) is a
SIGSEGV, not an exception. Operations that produce new tensors are fine;
``.clone()`` first to write. The tensors keep the mapping alive and see
what the daemon writes later, as the numpy views do.

SessionCache. The transformers ``Cache`` interface over a Session:
``update(key_states, value_states, layer_idx, cache_kwargs)`` sends the
new tokens to the daemon (as fp16) and returns the whole layer K/V as
tensors on ``device`` in the input's dtype. On the CPU with fp16 states
those are the zero-copy tensors above (views="none": copies the client
reconstructs, O(layer) per step). On a GPU the cache keeps one device
tensor per layer and fills it with zc_cuda_fetch_layer: the session's
compressed blocks and exact residual rows move and are reconstructed
there, bit-identical to the CPU, and each step moves only what is new
(a mirror per layer), O(new tokens); no fp16 view is needed, so a
views="none" session works the same. Without libzipcache_cuda it copies
the fp16 view's new and residual tokens instead (views="full" only). When transformers is
installed SessionCache subclasses ``transformers.Cache`` (layers subclass
its ``DynamicLayer``), so ``generate()`` takes it as ``past_key_values``;
without it SessionCache has the same methods and no base class.

CudaContext loads compressed blocks (the codec's payloads) straight into
device tensors through libzipcache_cuda, bit-identical to the CPU codec:
``load_layer`` for payloads in hand, ``fetch_layer`` for a session's layer
as the daemon holds it. ``to_device`` and ``SessionCache(device="cuda")``
use one context per GPU (``default_context``); its pins of a session's
blocks go with ``forget_session`` or the context.
"""

from __future__ import annotations

import ctypes
import warnings
import weakref
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from . import _cuda, _lib
from .client import CodecConfig, Session
from .errors import InvalidArgument, ResourceExhausted

__all__ = ["layer_tensors", "to_device", "SessionCache", "CudaContext", "default_context",
           "TRANSFORMERS"]

try:  # transformers >= 4.56: a Cache is a list of CacheLayerMixin layers
    from transformers.cache_utils import Cache as _HFCache
    from transformers.cache_utils import DynamicLayer as _HFLayer
except ImportError:  # not installed, or too old for the layers API
    _HFCache = None
    _HFLayer = None

#: True when SessionCache is a transformers Cache.
TRANSFORMERS = _HFCache is not None


def _tensor(array: np.ndarray) -> torch.Tensor:
    """torch.from_numpy of a read-only view, without the warning (see the module docstring)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def layer_tensors(session: Session, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K and V now as CPU float16 tensors [B, H, tokens, D] sharing the mapping.

    Read-only in fact (see the module docstring): clone before writing.
    """
    keys, values = session.view(layer)
    return _tensor(keys), _tensor(values)


def _layer_tokens(session: Session, layer: int) -> int:
    """The layer's token count from one consistent read (any views)."""
    tokens = 0
    for attempt in session.reads(layer):
        with attempt as r:
            tokens = r.tokens
    return tokens


def _cpu_layer(session: Session, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer on the CPU: the view's tensors (no copy), or views="none": reconstructed copies."""
    if session.info.views == "none":
        keys, values = session.reconstruct_layer(layer)
        return torch.from_numpy(keys), torch.from_numpy(values)
    return layer_tensors(session, layer)


def to_device(session: Session, layer: int, device: Any = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K and V on ``device`` as fresh float16 tensors [B, H, tokens, D].

    On a CUDA device with libzipcache_cuda the compressed blocks and the
    exact residual move and are reconstructed there (zc_cuda_fetch_layer,
    bit-identical to the CPU), queued on torch's current stream; else the
    layer is copied from the CPU (``layer_tensors``, or reconstructed for
    views="none").
    """
    dev = torch.device(device)
    if dev.type == "cuda" and cuda_available():
        ctx = default_context(dev)
        info = session.info
        tokens = _layer_tokens(session, layer)
        while True:
            keys = torch.empty((info.batch, info.kv_heads, tokens, info.head_dim_k),
                               dtype=torch.float16, device=dev)
            values = torch.empty((info.batch, info.kv_heads, tokens, info.head_dim_v),
                                 dtype=torch.float16, device=dev)
            try:
                held = ctx.fetch_layer(session, layer, keys, values)
            except ResourceExhausted as e:
                if e.code != _lib.ZC_EBUFFER:
                    raise
                tokens = _layer_tokens(session, layer)  # the layer grew since it was counted
                continue
            return keys[:, :, :held], values[:, :, :held]
    keys, values = _cpu_layer(session, layer)
    return keys.to(device), values.to(device)


# --- the transformers cache -------------------------------------------------------


def _query_length(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The query's token count, whichever way a transformers version passes it."""
    query = args[0] if args else kwargs.get("cache_position", kwargs.get("query_length"))
    if hasattr(query, "shape"):
        return int(query.shape[0])
    return int(query)


class _LayerCore:
    """One layer of a SessionCache: what it sends and what it hands back."""

    def __init__(self, session: Session, layer: int, device: Any) -> None:
        self.session = session
        self.layer = layer
        self.target_device = torch.device(device) if device is not None else None
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False
        # GPU mirror: one [B, H, max_tokens, D] fp16 tensor per side; with
        # libzipcache_cuda the context and the zc_cuda_mirror that fill it,
        # else how many leading tokens of it can no longer change.
        self._mirror: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fetch: tuple[CudaContext, Mirror] | None = None
        self._stable = 0

    def lazy_initialization(self, key_states: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _to_device(self, fetched: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device.type == "cpu":
            if isinstance(fetched, int):  # views="none": no view to share
                return _cpu_layer(self.session, self.layer)
            return _tensor(fetched[0]), _tensor(fetched[1])
        info = self.session.info
        if self._mirror is None or self._mirror[0].device != device:
            shape_k = (info.batch, info.kv_heads, info.max_tokens, info.head_dim_k)
            shape_v = (info.batch, info.kv_heads, info.max_tokens, info.head_dim_v)
            self._mirror = (torch.empty(shape_k, dtype=torch.float16, device=device),
                            torch.empty(shape_v, dtype=torch.float16, device=device))
            self._fetch = None
            self._stable = 0
        mk, mv = self._mirror
        if device.type == "cuda" and cuda_available():
            if self._fetch is None:
                ctx = default_context(device)
                self._fetch = (ctx, ctx.new_mirror())
            ctx, mirror = self._fetch
            tokens = ctx.fetch_layer(self.session, self.layer, mk, mv, mirror=mirror)
            return mk[:, :, :tokens], mv[:, :, :tokens]
        if isinstance(fetched, int):
            k, v = _cpu_layer(self.session, self.layer)
            mk[:, :, :fetched].copy_(k)
            mv[:, :, :fetched].copy_(v)
            return mk[:, :, :fetched], mv[:, :, :fetched]
        k, v = fetched
        tokens = k.shape[2]
        first = min(self._stable, tokens)
        if tokens > first:
            mk[:, :, first:tokens].copy_(_tensor(k[:, :, first:tokens]))
            mv[:, :, first:tokens].copy_(_tensor(v[:, :, first:tokens]))
        # Tokens before the residual are compressed and never rewritten.
        self._stable = tokens - self.session.last_residual_tokens(self.layer)
        return mk[:, :, :tokens], mv[:, :, :tokens]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        k = key_states.detach().to("cpu", torch.float16).contiguous().numpy()
        v = value_states.detach().to("cpu", torch.float16).contiguous().numpy()
        fetched = self.session.update_and_fetch(self.layer, k, v)
        device = self.target_device or key_states.device
        kt, vt = self._to_device(fetched, device)
        if key_states.dtype != torch.float16:
            kt, vt = kt.to(key_states.dtype), vt.to(key_states.dtype)
        self.keys, self.values = kt, vt
        return kt, vt

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return _layer_tokens(self.session, self.layer)

    def get_max_cache_shape(self, *args: Any, **kwargs: Any) -> int:
        return -1  # grows as it is fed (up to the session's max_tokens), like DynamicLayer

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """(kv_length, kv_offset) for a query: given as cache_position (a tensor) or a length."""
        return self.get_seq_length() + _query_length(args, kwargs), 0

    def crop(self, max_length: int) -> None:
        tokens = self.get_seq_length()
        if max_length < 0:
            max_length = tokens - abs(max_length)
        if tokens > max_length:
            self.session.trim_layer(self.layer, tokens - max_length)
            self._stable = min(self._stable, max(max_length, 0))
            if self._fetch is not None:  # the mirror is told: nothing left to guess
                self._fetch[1].trim(max(max_length, 0))
            self.keys = self.keys[:, :, :max_length] if self.keys is not None else None
            self.values = self.values[:, :, :max_length] if self.values is not None else None

    def reset(self) -> None:
        self.crop(0)

    def offload(self) -> None:
        pass  # the daemon holds the layer; nothing to move

    def prefetch(self) -> None:
        pass

    def _unsupported(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "a SessionCache layer is one daemon session's layer: beam search and batch "
            "reshaping would reorder the daemon's blocks; use greedy or sampled decoding, or "
            "open one session per sequence")

    reorder_cache = _unsupported
    batch_repeat_interleave = _unsupported
    batch_select_indices = _unsupported


if _HFLayer is not None:
    class _Layer(_LayerCore, _HFLayer):
        """A transformers DynamicLayer whose storage is the daemon's session layer."""

        is_sliding = False
        is_compileable = False

        def __init__(self, session: Session, layer: int, device: Any) -> None:
            try:
                _HFLayer.__init__(self)
            except TypeError:  # a DynamicLayer that wants arguments: ours needs none of them
                pass
            _LayerCore.__init__(self, session, layer, device)
else:
    class _Layer(_LayerCore):  # type: ignore[no-redef]
        is_sliding = False
        is_compileable = False


class _CacheMethods:
    """What SessionCache does, with or without transformers' Cache under it."""

    layers: list[_Layer]

    def _init_layers(self, session: Session, device: Any) -> list[_Layer]:
        self.session = session
        return [_Layer(session, i, device) for i in range(session.layers)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends [B, H, S, D] states to layer layer_idx; returns its whole K and V."""
        if not 0 <= layer_idx < len(self.layers):
            raise InvalidArgument(_lib.ZC_EINVALID,
                                  f"layer {layer_idx} of a {len(self.layers)}-layer session",
                                  operation="update")
        return self.layers[layer_idx].update(key_states, value_states, cache_kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """(kv_length, kv_offset) of layer_idx for a query (cache_position or its length)."""
        layer_idx = args[1] if len(args) > 1 else kwargs.get("layer_idx", 0)
        query = _query_length(args[:1], kwargs)
        if layer_idx >= len(self.layers):
            return query, 0
        return self.layers[layer_idx].get_seq_length() + query, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_usable_length(self, new_seq_length: int, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    @property
    def max_tokens(self) -> int:
        """The session's room per layer: more tokens than this are refused."""
        return self.session.info.max_tokens

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return len(self.layers) > 0 and all(layer.is_initialized for layer in self.layers)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    def crop(self, max_length: int) -> None:
        for layer in self.layers:
            layer.crop(max_length)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def reorder_cache(self, beam_idx: Any) -> None:
        self.layers[0]._unsupported()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.layers[0]._unsupported()

    def batch_select_indices(self, indices: Any) -> None:
        self.layers[0]._unsupported()

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx < len(self.layers):
            layer = self.layers[layer_idx]
            if layer.keys is None:
                return _cpu_layer(self.session, layer_idx)
            return layer.keys, layer.values
        raise KeyError(f"the cache has {len(self.layers)} layers, not {layer_idx + 1}")

    def __iter__(self):
        for i in range(len(self.layers)):
            yield self[i]

    def __repr__(self) -> str:
        return f"SessionCache({self.session!r}, layers={len(self.layers)})"


_BASES: tuple[type, ...] = (_CacheMethods, _HFCache) if _HFCache is not None else (_CacheMethods,)


class SessionCache(*_BASES):  # type: ignore[misc]
    """A transformers-style KV cache whose layers are a zipcached Session's layers.

    ``device``: where update() returns K/V (None: the device of the states
    passed in). The session's shape must match the model's (kv_heads,
    head_dim, layers); its codec config sets the precision (hi_bits =
    lo_bits = 8 is near-lossless). Beam search is not supported.
    """

    def __init__(self, session: Session, device: Any = None) -> None:
        layers = self._init_layers(session, device)
        if _HFCache is not None:
            try:
                _HFCache.__init__(self, layers=layers)
            except TypeError:  # a Cache whose constructor takes no layers
                _HFCache.__init__(self)
        self.layers = layers


# --- compressed blocks to the GPU ---------------------------------------------------


def _strides(t: torch.Tensor) -> _lib.zc_strides:
    s = t.stride()
    if t.dim() != 4 or s[3] != 1:
        raise InvalidArgument(_lib.ZC_ESHAPE, f"a target is [B, H, S, D] with unit channel stride, "
                              f"got shape {tuple(t.shape)} strides {s}", operation="load_layer")
    return _lib.zc_strides(s[0], s[1], s[2])


class CudaContext:
    """libzipcache_cuda on one GPU: compressed blocks into device tensors.

    ``load_layer`` takes payloads as the codec writes them (zipcache.codec
    .compress, or later the daemon's blocks): host bytes are moved through
    pinned bounce buffers and reconstructed by CUDA kernels, bit-identical
    to zipcache.codec.reconstruct. The work is queued on ``stream`` (a
    torch.cuda.Stream; None: torch's current stream) and ordered with
    torch's work on it.
    """

    def __init__(self, device: int = 0, chunk_bytes: int = 0) -> None:
        self._lib = _cuda.library()
        ptr = ctypes.c_void_p()
        _cuda.check(None, self._lib.zc_cuda_open(device, chunk_bytes, ctypes.byref(ptr)), "open")
        self._ptr = ptr.value
        self.device = device
        # The sessions fetched from, each with a release hook that drops
        # its pins before its mappings go.
        self._sessions: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

    def close(self) -> None:
        if getattr(self, "_ptr", None):
            self._lib.zc_cuda_close(self._ptr)
            self._ptr = None
            self._sessions.clear()

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> "CudaContext":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def new_mirror(self) -> "Mirror":
        return Mirror(self._lib)

    def load_layer(self, config: CodecConfig, shape: tuple[int, int, int, int],
                   blocks: Sequence[tuple[bytes, bytes, int, int]], keys: torch.Tensor,
                   values: torch.Tensor, *, residual: tuple[np.ndarray, np.ndarray, int] | None = None,
                   mirror: "Mirror | None" = None, stream: Any = None) -> None:
        """Reconstructs blocks into keys/values (device float16 [B, H, >=S, D] tensors).

        shape: (batch, heads, head_dim_k, head_dim_v). blocks: (key payload,
        value payload, first_token, tokens) each. residual: exact float16
        [B, H, R, D] keys and values and the token of their row 0.
        """
        batch, heads, dk, dv = shape
        for t in (keys, values):
            if t.dtype != torch.float16 or not t.is_cuda:
                raise InvalidArgument(_lib.ZC_EINVALID, "targets are CUDA float16 tensors",
                                      operation="load_layer")
        keep: list[Any] = []
        cblocks = (_cuda.zc_cuda_block * max(len(blocks), 1))()
        for i, (kp, vp, first, tokens) in enumerate(blocks):
            kb, vb = ctypes.create_string_buffer(bytes(kp), len(kp)), ctypes.create_string_buffer(bytes(vp), len(vp))
            keep += [kb, vb]
            cblocks[i] = _cuda.zc_cuda_block(ctypes.addressof(kb), ctypes.addressof(vb), len(kp),
                                             len(vp), first, tokens, tokens)
        layer = _cuda.zc_cuda_layer()
        layer.config = config.to_c()
        layer.batch, layer.heads, layer.head_dim_k, layer.head_dim_v = batch, heads, dk, dv
        layer.blocks = cblocks
        layer.n_blocks = len(blocks)
        layer.memory = _cuda.ZC_CUDA_HOST
        if residual is not None:
            rk, rv, first = residual
            rk = np.ascontiguousarray(rk, dtype="<f2")
            rv = np.ascontiguousarray(rv, dtype="<f2")
            keep += [rk, rv]
            layer.residual_keys = rk.ctypes.data
            layer.residual_values = rv.ctypes.data
            layer.residual_key_strides = _lib.zc_strides(*(s // 2 for s in rk.strides[:3]))
            layer.residual_value_strides = _lib.zc_strides(*(s // 2 for s in rv.strides[:3]))
            layer.residual_first = first
            layer.residual_tokens = rk.shape[2]
        target = _cuda.zc_cuda_target(keys.data_ptr(), values.data_ptr(), _strides(keys),
                                      _strides(values), min(keys.shape[2], values.shape[2]))
        if stream is None:
            stream = torch.cuda.current_stream(keys.device)
        handle = stream.cuda_stream if hasattr(stream, "cuda_stream") else stream
        _cuda.check(self._ptr, self._lib.zc_cuda_load_layer(
            self._ptr, ctypes.byref(layer), ctypes.byref(target),
            mirror._ptr if mirror is not None else None, handle), "load_layer")

    def fetch_layer(self, session: Session, layer: int, keys: torch.Tensor, values: torch.Tensor,
                    *, mirror: "Mirror | None" = None, stream: Any = None) -> int:
        """A session's layer into keys/values (CUDA float16 [B, H, >=tokens, D]); its token count.

        zc_cuda_fetch_layer: the blocks and residual rows of one consistent
        read, reconstructed on ``stream`` (None: torch's current stream),
        views "none" or "full". With a mirror only what is new since the
        last fetch through it moves. ResourceExhausted (ZC_EBUFFER) when the tensors have
        room for fewer tokens than the layer holds (nothing is written).
        """
        for t in (keys, values):
            if t.dtype != torch.float16 or not t.is_cuda:
                raise InvalidArgument(_lib.ZC_EINVALID, "targets are CUDA float16 tensors",
                                      operation="fetch_layer")
        layer = session._check_layer(layer, "fetch_layer")
        handle = session._native()
        target = _cuda.zc_cuda_target(keys.data_ptr(), values.data_ptr(), _strides(keys),
                                      _strides(values), min(keys.shape[2], values.shape[2]))
        if stream is None:
            stream = torch.cuda.current_stream(keys.device)
        sh = stream.cuda_stream if hasattr(stream, "cuda_stream") else stream
        if id(session) not in self._sessions:
            # Its pins go before its mappings do.
            self._sessions[id(session)] = session
            context = weakref.ref(self)
            session._release_hooks.append(
                lambda: context() is not None and context().forget_session(session))
        return _cuda.check(self._ptr, self._lib.zc_cuda_fetch_layer(
            self._ptr, handle.ptr, layer, ctypes.byref(target),
            mirror._ptr if mirror is not None else None, sh), "fetch_layer")

    def forget_session(self, session: Session) -> None:
        """Unpins what fetches pinned of the session's blocks (before releasing it)."""
        handle = session._handle
        if handle is not None and self._ptr:
            self._lib.zc_cuda_forget_session(self._ptr, handle.ptr)
        self._sessions.pop(id(session), None)

    def synchronize(self, stream: Any = None) -> None:
        """Waits for the stream; raises Internal if a kernel found a corrupt payload."""
        if stream is None:
            stream = torch.cuda.current_stream()
        handle = stream.cuda_stream if hasattr(stream, "cuda_stream") else stream
        _cuda.check(self._ptr, self._lib.zc_cuda_synchronize(self._ptr, handle), "synchronize")

    def stats(self) -> dict[str, int]:
        s = _cuda.zc_cuda_stats()
        self._lib.zc_cuda_get_stats(self._ptr, ctypes.byref(s))
        return {name: getattr(s, name) for name, _ in s._fields_}


class Mirror:
    """What earlier loads put into one target, so the next moves only what is new."""

    def __init__(self, cdll: ctypes.CDLL) -> None:
        self._lib = cdll
        ptr = ctypes.c_void_p()
        _cuda.check(None, cdll.zc_cuda_mirror_new(ctypes.byref(ptr)), "mirror")
        self._ptr = ptr.value

    def trim(self, tokens: int) -> None:
        self._lib.zc_cuda_mirror_trim(self._ptr, tokens)

    def __del__(self) -> None:
        if self._ptr:
            self._lib.zc_cuda_mirror_free(self._ptr)
            self._ptr = None


_contexts: dict[int, CudaContext] = {}


def default_context(device: Any = "cuda") -> CudaContext:
    """The CudaContext this module uses for ``device`` (one per GPU, made on first use)."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    ctx = _contexts.get(index)
    if ctx is None:
        ctx = _contexts[index] = CudaContext(index)
    return ctx


def cuda_available() -> bool:
    """True when libzipcache_cuda loads and sees a GPU."""
    try:
        return _cuda.library().zc_cuda_device_count() > 0
    except ImportError:
        return False
