#!/usr/bin/python3
"""Checks the deployment files in deploy/ against each other and the daemon.

    python3 deploy/check.py [--zipcached BIN] [--metrics-url URL] [--only SECTION]
                            [DEPLOY_DIR]

Sections (all by default):
  yaml        every *.yml / *.yaml parses (all documents of a multi-document file)
  kubernetes  the manifests: names, images, resources, probes on /healthz:9464,
              scrape annotations, the socket and /dev/shm volumes, known flags
  prometheus  the scrape job and rules; `promtool check config` when installed
  grafana     the dashboard parses, its panels and queries use zipcached's
              metric names; each query through promtool when installed
  systemd     the unit's directives and flags; `systemd-analyze verify` when
              installed
  container   the Containerfile against the manifests: Debian 12 base, image
              tag and version, user, program, socket and session paths, and
              (with --zipcached, where readelf and dpkg are) that the runtime
              stage installs the libraries the daemon links

--zipcached BIN: flags in the unit and the manifests must be ones `BIN --help`
lists (a flag the daemon does not know makes it exit at start).
--metrics-url URL: a running daemon's /metrics; the metric names that the
dashboard and the rules use must be families it exports (instead of the
list below).

Exit status: 0 all checked sections pass; 1 a problem (one line each on
stderr); 2 usage error or python3-yaml missing; 77 the one section asked
for with --only could not run here (its tool is missing), as automake's
test drivers read it.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:
    print("check.py: the python3 yaml module is missing (Debian package python3-yaml)",
          file=sys.stderr)
    sys.exit(2)

SKIP = 77

# The image's base (Debian 12), and the package of its C library, which
# every Debian image holds and the Containerfile need not install.
CONTAINER_BASE = "debian:bookworm-slim"
CONTAINER_BASE_PACKAGES = {"libc6"}
# Sanitizer runtimes a `make asan` daemon links; the image's build is not one.
SANITIZER_LIBRARY = re.compile(r"^lib(a|ub|t|l|hwa)san\.so")

# What zipcached exports (server/metrics.c); a dashboard or rule naming
# anything else plots nothing. --metrics-url replaces it with the truth.
METRICS = {
    "zipcache_requests_total",
    "zipcache_request_duration_seconds",
    "zipcache_request_duration_seconds_bucket",
    "zipcache_request_duration_seconds_sum",
    "zipcache_request_duration_seconds_count",
    "zipcache_sessions",
    "zipcache_stored_tokens",
    "zipcache_stored_bytes",
    "zipcache_compression_ratio",
    "zipcache_memory_used_bytes",
    "zipcache_memory_budget_bytes",
    "zipcache_view_rebuilds_total",
    "zipcache_view_drops_total",
    "zipcache_idle_view_drops_total",
    "zipcache_shared_block_bytes",
    "zipcache_relief_steps_total",
    "zipcache_connections",
    "zipcache_connections_total",
    "zipcache_errors_total",
    "zipcache_tokens_appended_total",
    "zipcache_request_rings",
    "zipcache_ring_requests_total",
    "zipcache_ring_replies_total",
    "zipcache_ring_doorbells_total",
    "zipcache_ring_nudges_total",
    "zipcache_uptime_seconds",
    "zipcache_build_info",
}
METRICS_PORT = 9464
HEALTH_PATH = "/healthz"

# The hardening the unit promises (deploy/zipcached.service), by directive.
UNIT_REQUIRED = {
    "Type": "notify",
    "User": None,
    "RuntimeDirectory": "zipcached",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "NoNewPrivileges": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "MemoryMax": None,
    "LimitNOFILE": None,
    "ReadWritePaths": None,
    "Restart": "on-failure",
    "RemoveIPC": "no",
}
# Directives that would break zipcached (see the comments in the unit).
UNIT_FORBIDDEN = {
    "DynamicUser": "implies RemoveIPC=yes, which deletes the session files on stop",
    "PrivateDevices": "gives the service its own /dev/shm, lost with the service",
    "PrivateUsers": "makes SO_PEERCRED report every client as one uid",
}


class Checker:
    def __init__(self, root, zipcached, metrics):
        self.root = root
        self.zipcached = zipcached
        self.metrics = metrics
        self.problems = 0
        self.notes = []
        self._flags = None

    def fail(self, where, message):
        self.problems += 1
        # One line per problem, whatever the tool that found it printed.
        message = " / ".join(line.strip() for line in str(message).splitlines() if line.strip())
        print(f"check.py: {where}: {message}", file=sys.stderr)

    def rel(self, path):
        return os.path.relpath(path, self.root)

    def files(self, *suffixes):
        found = []
        for directory, _, names in os.walk(self.root):
            for name in names:
                if name.endswith(suffixes):
                    found.append(os.path.join(directory, name))
        return sorted(found)

    def load_yaml(self, path):
        with open(path, encoding="utf-8") as stream:
            return [doc for doc in yaml.safe_load_all(stream) if doc is not None]

    # ---- the daemon's flags ----

    def known_flags(self):
        """The long options `zipcached --help` lists, or None without a binary."""
        if self._flags is None and self.zipcached:
            out = subprocess.run([self.zipcached, "--help"], capture_output=True, text=True,
                                 timeout=30)
            if out.returncode != 0:
                raise SystemExit(f"check.py: {self.zipcached} --help failed: {out.stderr.strip()}")
            self._flags = set(re.findall(r"^\s+(--[a-z0-9-]+)", out.stdout, re.M))
        return self._flags

    def check_flags(self, where, arguments):
        """arguments: the daemon's argv after the program name. Returns {flag: value}."""
        known = self.known_flags()
        values = {}
        i = 0
        while i < len(arguments):
            argument = arguments[i]
            i += 1
            if not argument.startswith("--"):
                self.fail(where, f"unexpected argument {argument!r} to zipcached")
                continue
            flag, equals, value = argument.partition("=")
            if not equals and flag not in ("--no-adopt",) and i < len(arguments):
                value = arguments[i]
                i += 1
            if known is not None and flag not in known:
                self.fail(where, f"zipcached has no flag {flag} (see zipcached --help)")
            values[flag] = value
        return values

    # ---- sections ----

    def section_yaml(self):
        paths = self.files(".yml", ".yaml")
        if not paths:
            self.fail(self.root, "no YAML files")
        for path in paths:
            try:
                documents = self.load_yaml(path)
            except yaml.YAMLError as error:
                self.fail(self.rel(path), f"not valid YAML: {error}")
                continue
            if not documents:
                self.fail(self.rel(path), "no YAML document")
        return True

    def section_kubernetes(self):
        paths = self.files(".yaml")
        manifests = 0
        for path in paths:
            try:
                documents = self.load_yaml(path)
            except yaml.YAMLError:
                continue   # reported by the yaml section
            for index, doc in enumerate(documents):
                if not isinstance(doc, dict) or "kind" not in doc:
                    continue
                manifests += 1
                self.check_manifest(f"{self.rel(path)}[{index}]", doc)
        if manifests == 0:
            self.fail(self.root, "no Kubernetes manifests")
        return True

    def check_manifest(self, where, doc):
        for key in ("apiVersion", "kind", "metadata"):
            if key not in doc:
                self.fail(where, f"no {key}")
                return
        if not doc["metadata"].get("name"):
            self.fail(where, "no metadata.name")
        kind = doc["kind"]
        if kind == "Pod":
            self.check_pod(where, doc["metadata"], doc.get("spec") or {}, shared_socket=True)
        elif kind in ("DaemonSet", "Deployment", "StatefulSet"):
            template = (doc.get("spec") or {}).get("template") or {}
            selector = ((doc.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
            labels = (template.get("metadata") or {}).get("labels") or {}
            for key, value in selector.items():
                if labels.get(key) != value:
                    self.fail(where, f"selector {key}={value} does not match the pod template")
            self.check_pod(where, template.get("metadata") or {}, template.get("spec") or {},
                           shared_socket=False)

    def check_pod(self, where, metadata, spec, shared_socket):
        volumes = {v.get("name"): v for v in spec.get("volumes") or []}
        containers = list(spec.get("containers") or []) + list(spec.get("initContainers") or [])
        if not spec.get("containers"):
            self.fail(where, "no containers")
        for container in containers:
            name = container.get("name", "?")
            here = f"{where} container {name}"
            if not container.get("image"):
                self.fail(here, "no image")
            resources = container.get("resources") or {}
            for part in ("requests", "limits"):
                if not (resources.get(part) or {}).get("memory"):
                    self.fail(here, f"no resources.{part}.memory")
            for mount in container.get("volumeMounts") or []:
                if mount.get("name") not in volumes:
                    self.fail(here, f"mounts undefined volume {mount.get('name')!r}")
        daemons = [c for c in containers if c.get("name") == "zipcached"]
        if not daemons:
            # A worker of the node daemon: it must mount the node's socket directory.
            for container in containers:
                if any(m.get("mountPath") == "/run/zipcached" for m in container.get("volumeMounts") or []):
                    return
            self.fail(where, "neither a zipcached container nor a mount of its socket directory")
            return
        daemon = daemons[0]
        here = f"{where} container zipcached"
        if daemon in (spec.get("initContainers") or []) and daemon.get("restartPolicy") != "Always":
            self.fail(here, "an init container that is not a sidecar (restartPolicy: Always)")
        arguments = list(daemon.get("command") or [])[1:] + list(daemon.get("args") or [])
        flags = self.check_flags(here, arguments)
        listen = flags.get("--metrics-listen", "127.0.0.1:9464")
        host, _, port = listen.rpartition(":")
        if port != str(METRICS_PORT) or host not in ("0.0.0.0", "[::]", ""):
            self.fail(here, f"--metrics-listen {listen} is not reachable at the pod IP on port "
                            f"{METRICS_PORT} (probes and Prometheus need 0.0.0.0:{METRICS_PORT})")
        annotations = metadata.get("annotations") or {}
        if annotations.get("prometheus.io/scrape") != "true":
            self.fail(where, 'no annotation prometheus.io/scrape: "true"')
        if annotations.get("prometheus.io/port") != str(METRICS_PORT):
            self.fail(where, f'annotation prometheus.io/port is not "{METRICS_PORT}"')
        probes = ["readinessProbe", "livenessProbe"]
        if "startupProbe" in daemon:
            probes.append("startupProbe")
        for probe in probes:
            get = (daemon.get(probe) or {}).get("httpGet") or {}
            if get.get("path") != HEALTH_PATH or get.get("port") != METRICS_PORT:
                self.fail(here, f"{probe} is not httpGet {HEALTH_PATH} on port {METRICS_PORT}")
        mounts = {m.get("mountPath"): m.get("name") for m in daemon.get("volumeMounts") or []}

        def volume_of(path):
            """The volume whose mount holds path (the longest matching mountPath)."""
            best = None
            for mount_path, volume in mounts.items():
                if path == mount_path or path.startswith(mount_path.rstrip("/") + "/"):
                    if best is None or len(mount_path) > len(best[0]):
                        best = (mount_path, volume)
            return (best[1], volumes.get(best[1])) if best else (None, None)

        socket = flags.get("--socket")
        if not socket:
            self.fail(here, "no --socket (the default path is not on a shared volume)")
        else:
            name, volume = volume_of(socket)
            if volume is None:
                self.fail(here, f"--socket {socket} is not on a mounted volume")
            elif shared_socket:
                users = [c for c in containers if c is not daemon and
                         any(m.get("name") == name for m in c.get("volumeMounts") or [])]
                if "emptyDir" not in volume or not users:
                    self.fail(here, f"the socket volume {name!r} is not an emptyDir shared with the worker")
                for user in users:
                    env = {e.get("name"): e.get("value") for e in user.get("env") or []}
                    if env.get("ZIPCACHE_SOCKET") != socket:
                        self.fail(f"{where} container {user.get('name')}",
                                  f"ZIPCACHE_SOCKET is not {socket}")
            elif "hostPath" not in volume:
                self.fail(here, f"the socket volume {name!r} is not a hostPath")
        shm = flags.get("--shm-dir")
        if not shm:
            self.fail(here, "no --shm-dir")
        else:
            name, volume = volume_of(shm)
            if volume is None:
                self.fail(here, f"--shm-dir {shm} is not on a mounted volume")
            elif shared_socket and ((volume.get("emptyDir") or {}).get("medium") != "Memory"
                                    or mounts.get("/dev/shm") != name):
                self.fail(here, f"--shm-dir {shm} is not on a memory-backed emptyDir at /dev/shm")
            elif not shared_socket and "hostPath" not in volume:
                self.fail(here, f"--shm-dir {shm} is not on a hostPath")

    def section_prometheus(self):
        path = os.path.join(self.root, "prometheus.yml")
        if not os.path.exists(path):
            self.fail(self.root, "no prometheus.yml")
            return True
        try:
            config = self.load_yaml(path)[0]
        except (yaml.YAMLError, IndexError) as error:
            self.fail(self.rel(path), f"unreadable: {error}")
            return True
        jobs = {job.get("job_name"): job for job in config.get("scrape_configs") or []}
        job = jobs.get("zipcached")
        targets = [t for c in (job or {}).get("static_configs") or [] for t in c.get("targets") or []]
        if f"127.0.0.1:{METRICS_PORT}" not in targets:
            self.fail(self.rel(path), f"no job zipcached scraping 127.0.0.1:{METRICS_PORT}")
        for rules_path in self.files("rules.yml", "rules.yaml"):
            for group in (self.load_yaml(rules_path) or [{}])[0].get("groups") or []:
                for rule in group.get("rules") or []:
                    self.check_metric_names(self.rel(rules_path), rule.get("expr", ""))
        promtool = shutil.which("promtool")
        if not promtool:
            self.notes.append("promtool not found: prometheus.yml not checked by promtool")
            return False
        out = subprocess.run([promtool, "check", "config", path], capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 0:
            self.fail(self.rel(path), "promtool check config: " + (out.stderr + out.stdout).strip())
        return True

    def check_metric_names(self, where, expr):
        for name in re.findall(r"\b(zipcache_[a-z0-9_]+)", expr):
            if name not in self.metrics:
                self.fail(where, f"unknown metric {name} in {expr!r}")

    def section_grafana(self):
        paths = self.files(".json")
        if not paths:
            self.fail(self.root, "no Grafana dashboard (*.json)")
        exprs = []
        for path in paths:
            where = self.rel(path)
            try:
                with open(path, encoding="utf-8") as stream:
                    dashboard = json.load(stream)
            except ValueError as error:
                self.fail(where, f"not valid JSON: {error}")
                continue
            if not dashboard.get("title") or not isinstance(dashboard.get("panels"), list):
                self.fail(where, "not a dashboard (no title or panels)")
                continue
            variables = {v.get("name") for v in (dashboard.get("templating") or {}).get("list") or []}
            ids = set()
            for panel in dashboard["panels"]:
                title = panel.get("title", "?")
                if panel.get("id") in ids:
                    self.fail(where, f"panel id {panel.get('id')} repeats")
                ids.add(panel.get("id"))
                for key in ("x", "y", "w", "h"):
                    if not isinstance((panel.get("gridPos") or {}).get(key), int):
                        self.fail(where, f"panel {title!r} has no gridPos.{key}")
                for target in panel.get("targets") or []:
                    expr = target.get("expr", "")
                    if not expr:
                        self.fail(where, f"panel {title!r} has a target without expr")
                    self.check_metric_names(f"{where} panel {title!r}", expr)
                    for variable in re.findall(r"\$\{?([A-Za-z_]\w*)", expr):
                        if variable not in variables and not variable.startswith("__"):
                            self.fail(where, f"panel {title!r} uses undefined variable ${variable}")
                    exprs.append((f"{where} panel {title!r}", expr))
            text = " ".join(expr for _, expr in exprs)
            wanted = {
                "compression ratio": r"zipcache_compression_ratio",
                "stored bytes": r"zipcache_stored_bytes",
                "latency p50": r"histogram_quantile\(0\.5,.*zipcache_request_duration_seconds_bucket",
                "latency p99": r"histogram_quantile\(0\.99,.*zipcache_request_duration_seconds_bucket",
                "sessions": r"zipcache_sessions",
                "error rate": r"rate\(zipcache_errors_total",
            }
            for what, pattern in wanted.items():
                if not re.search(pattern, text):
                    self.fail(where, f"no panel for {what}")
        promtool = shutil.which("promtool")
        if not promtool:
            self.notes.append("promtool not found: dashboard queries not parsed")
            return False
        # promtool parses PromQL in rule files: make each query a recording
        # rule, with Grafana's variables replaced by what they expand to.
        rules = {"groups": [{"name": "dashboard", "rules": []}]}
        for index, (_, expr) in enumerate(exprs):
            expr = expr.replace("$__rate_interval", "5m").replace("$instance", ".*")
            rules["groups"][0]["rules"].append({"record": f"dashboard:query{index}", "expr": expr})
        with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as stream:
            yaml.safe_dump(rules, stream)
            rules_path = stream.name
        try:
            out = subprocess.run([promtool, "check", "rules", rules_path], capture_output=True,
                                 text=True, timeout=60)
        finally:
            os.unlink(rules_path)
        if out.returncode != 0:
            self.fail("grafana", "a dashboard query does not parse: " + (out.stderr + out.stdout).strip())
        return True

    def section_systemd(self):
        path = os.path.join(self.root, "zipcached.service")
        where = self.rel(path)
        if not os.path.exists(path):
            self.fail(self.root, "no zipcached.service")
            return True
        with open(path, encoding="utf-8") as stream:
            text = stream.read().replace("\\\n", " ")
        settings = {}
        section = None
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line
                continue
            key, _, value = line.partition("=")
            settings.setdefault((section, key.strip()), []).append(" ".join(value.split()))
        service = {key: values for (section_name, key), values in settings.items()
                   if section_name == "[Service]"}
        for key, value in UNIT_REQUIRED.items():
            if key not in service:
                self.fail(where, f"no {key}=")
            elif value is not None and value not in service[key]:
                self.fail(where, f"{key}= is not {value}")
        for key, why in UNIT_FORBIDDEN.items():
            if service.get(key, ["no"])[-1] not in ("no", "false", "0"):
                self.fail(where, f"{key}= {why}")
        exec_start = (service.get("ExecStart") or [""])[-1].split()
        if not exec_start:
            self.fail(where, "no ExecStart=")
            return True
        flags = self.check_flags(where, exec_start[1:])
        if not flags.get("--socket", "").startswith("%t/zipcached/"):
            self.fail(where, "--socket is not in the RuntimeDirectory (%t/zipcached/)")
        if not flags.get("--shm-dir", "").startswith("/dev/shm/"):
            self.fail(where, "--shm-dir is not under /dev/shm")
        analyze = shutil.which("systemd-analyze")
        if not analyze:
            self.notes.append("systemd-analyze not found: the unit was not verified")
            return False
        # verify insists that ExecStart's program exists: point it at the
        # build's daemon (or any executable) in a copy of the unit.
        program = self.zipcached or shutil.which("true")
        with tempfile.TemporaryDirectory() as directory:
            copy = os.path.join(directory, "zipcached.service")
            with open(path, encoding="utf-8") as stream:
                unit = stream.read().replace(exec_start[0], os.path.abspath(program))
            with open(copy, "w", encoding="utf-8") as stream:
                stream.write(unit)
            out = subprocess.run([analyze, "verify", copy], capture_output=True, text=True,
                                 timeout=120)
            # Warnings about the unit are problems too (verify exits 0 on an
            # unknown key); lines about other units on this host are not ours.
            ours = [line for line in (out.stdout + out.stderr).splitlines()
                    if "zipcached.service" in line or copy in line]
            if out.returncode != 0 or ours:
                self.fail(where, "systemd-analyze verify: " + " | ".join(
                    ours or [(out.stdout + out.stderr).strip()]))
        return True

    # ---- the container image ----

    def section_container(self):
        path = os.path.join(self.root, "Containerfile")
        where = self.rel(path)
        if not os.path.exists(path):
            self.fail(self.root, "no Containerfile")
            return True
        stages = parse_containerfile(path)
        if not stages:
            self.fail(where, "no FROM")
            return True
        names = {stage["name"] for stage in stages if stage["name"]}
        for stage in stages:
            if stage["base"] not in names and stage["base"] != CONTAINER_BASE:
                self.fail(where, f"FROM {stage['base']} is not {CONTAINER_BASE} (Debian 12)")
        final = stages[-1]
        if not any(keyword == "RUN" and re.search(r"\bmake\b", text)
                   for stage in stages[:-1] for keyword, text in stage["steps"]):
            self.fail(where, "no build stage that runs make")
        steps = final["steps"]

        def last(keyword):
            values = [text for k, text in steps if k == keyword]
            return values[-1] if values else None

        user = last("USER") or ""
        uid, _, gid = user.partition(":")
        if not (uid.isdigit() and gid.isdigit()):
            self.fail(where, f"USER {user or '(none)'} is not a numeric uid:gid "
                             "(runAsNonRoot can only check a number)")
        try:
            entrypoint = json.loads(last("ENTRYPOINT") or "[]")
            command = json.loads(last("CMD") or "[]")
        except ValueError:
            self.fail(where, "ENTRYPOINT and CMD must be JSON arrays (exec form)")
            return True
        flags = self.check_flags(f"{where} CMD", command)
        program = entrypoint[0] if entrypoint else ""
        copies = [text.split()[-1] for k, text in steps if k == "COPY" and "--from=" in text]
        if not any(program.startswith(destination.rstrip("/") + "/") for destination in copies):
            self.fail(where, f"ENTRYPOINT {program or '(none)'} is not where a COPY --from put the build")
        run_text = " ".join(text for k, text in steps if k == "RUN")
        for option, wanted in (("--uid", uid), ("--gid", gid)):
            if not re.search(rf"{option} {re.escape(wanted)}\b", run_text):
                self.fail(where, f"the final stage creates no user or group with {option} {wanted}")
        socket_dir = os.path.dirname(flags.get("--socket", ""))
        if not socket_dir or socket_dir not in run_text:
            self.fail(where, f"the socket's directory {socket_dir or '(no --socket)'} is not created")
        version = dict(re.findall(r'([\w.]+)="([^"]*)"', last("LABEL") or "")).get(
            "org.opencontainers.image.version")
        source_version = self.source_version()
        if not version:
            self.fail(where, "no LABEL org.opencontainers.image.version")
        elif source_version and version != source_version:
            self.fail(where, f"image version {version} is not the program's {source_version} "
                             "(proto/version.h)")
        installed = set()
        for text in (t for k, t in steps if k == "RUN"):
            for match in re.finditer(r"apt-get install ((?:-\S+\s+)*)([^&;|]+)", text):
                installed.update(word for word in match.group(2).split() if not word.startswith("-"))
        for package in sorted(installed):
            if package.endswith("-dev") or package in ("gcc", "make", "python3"):
                self.fail(where, f"the runtime stage installs {package}, a build tool")

        for here, pod, container in self.daemon_containers():
            image = container.get("image") or ""
            repository, _, tag = image.rpartition(":")
            if repository.rpartition("/")[2] != "zipcached" or tag != version:
                self.fail(here, f"image {image} is not the Containerfile's zipcached:{version}")
            context = dict(pod.get("securityContext") or {})
            context.update(container.get("securityContext") or {})
            if str(context.get("runAsUser")) != uid or str(context.get("runAsGroup")) != gid:
                self.fail(here, f"runs as {context.get('runAsUser')}:{context.get('runAsGroup')}, "
                                f"the image's USER is {user}")
            manifest_command = list(container.get("command") or [])
            if manifest_command[:1] != [program]:
                self.fail(here, f"command {manifest_command[:1]} is not the image's ENTRYPOINT {program}")
            manifest_flags = self.check_flags(here, manifest_command[1:] + list(container.get("args") or []))
            for flag in ("--socket", "--shm-dir"):
                if manifest_flags.get(flag) != flags.get(flag):
                    self.fail(here, f"{flag} {manifest_flags.get(flag)} is not the image's "
                                    f"{flags.get(flag)}")
        return self.check_runtime_libraries(where, installed)

    def daemon_containers(self):
        """(where, pod spec, container) of every zipcached container in the manifests."""
        for path in self.files(".yaml"):
            try:
                documents = self.load_yaml(path)
            except yaml.YAMLError:
                continue   # reported by the yaml section
            for index, doc in enumerate(documents):
                if not isinstance(doc, dict):
                    continue
                spec = doc.get("spec") or {}
                if doc.get("kind") != "Pod":
                    spec = (spec.get("template") or {}).get("spec") or {}
                for container in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
                    if container.get("name") == "zipcached":
                        yield f"{self.rel(path)}[{index}] container zipcached", spec, container

    def source_version(self):
        """ZIPCACHE_VERSION of the source tree above deploy/, or None outside one."""
        path = os.path.join(self.root, os.pardir, "proto", "version.h")
        try:
            with open(path, encoding="utf-8") as stream:
                found = re.search(r'^#define ZIPCACHE_VERSION "([^"]+)"', stream.read(), re.M)
        except OSError:
            return None
        return found.group(1) if found else None

    def check_runtime_libraries(self, where, installed):
        """The packages of the libraries the daemon links (NEEDED) are installed."""
        readelf, dpkg = shutil.which("readelf"), shutil.which("dpkg")
        if not (self.zipcached and readelf and dpkg):
            self.notes.append("no --zipcached, readelf or dpkg: the image's runtime libraries "
                              "were not compared with the daemon's")
            return False
        out = subprocess.run([readelf, "-d", self.zipcached], capture_output=True, text=True,
                             timeout=60)
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out.stdout)
        if out.returncode != 0 or not needed:
            self.fail(where, f"readelf -d {self.zipcached}: {out.stderr.strip() or 'no NEEDED'}")
            return True
        for soname in needed:
            if SANITIZER_LIBRARY.match(soname):
                continue
            owner = subprocess.run([dpkg, "-S", f"*/{soname}"], capture_output=True, text=True,
                                   timeout=60)
            packages = {line.split(":")[0] for line in owner.stdout.splitlines() if ":" in line}
            if not packages:
                self.notes.append(f"no Debian package holds {soname}: not compared")
                continue
            if not packages & (installed | CONTAINER_BASE_PACKAGES):
                self.fail(where, f"zipcached needs {soname} ({' or '.join(sorted(packages))}), "
                                 "which the runtime stage does not install")
        return True


def parse_containerfile(path):
    """Stages of a Containerfile: [{base, name, steps: [(KEYWORD, text)]}]."""
    with open(path, encoding="utf-8") as stream:
        lines = [line for line in stream.read().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    stages = []
    for line in text.splitlines():
        keyword, _, rest = line.strip().partition(" ")
        keyword, rest = keyword.upper(), " ".join(rest.split())
        if not keyword:
            continue
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append({"base": words[0] if words else "", "name": name, "steps": []})
        elif stages:
            stages[-1]["steps"].append((keyword, rest))
    return stages


SECTIONS = ("yaml", "kubernetes", "prometheus", "grafana", "systemd", "container")


def exported_metrics(url):
    """Metric names a daemon's /metrics exports, with each histogram's series."""
    from urllib.request import urlopen
    with urlopen(url, timeout=30) as response:
        text = response.read().decode("utf-8")
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names.add(name)
        if kind == "histogram":
            names.update({name + "_bucket", name + "_sum", name + "_count"})
        elif kind == "summary":
            names.update({name + "_sum", name + "_count"})
    if not names:
        raise SystemExit(f"check.py: {url} exports no metric families")
    return names


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--zipcached", help="the daemon binary whose --help lists the valid flags")
    parser.add_argument("--metrics-url", help="a running daemon's /metrics, the metric names' truth")
    parser.add_argument("--only", choices=SECTIONS)
    arguments = parser.parse_args()
    if not os.path.isdir(arguments.directory):
        parser.error(f"no directory {arguments.directory}")
    metrics = exported_metrics(arguments.metrics_url) if arguments.metrics_url else METRICS
    checker = Checker(os.path.abspath(arguments.directory), arguments.zipcached, metrics)
    ran = []
    for section in SECTIONS:
        if arguments.only in (None, section):
            ran.append(getattr(checker, "section_" + section)())
    for note in checker.notes:
        print(f"check.py: note: {note}")
    if checker.problems:
        print(f"check.py: {checker.problems} problem(s)", file=sys.stderr)
        return 1
    if arguments.only and not all(ran):
        return SKIP
    print("check.py: deploy files ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
