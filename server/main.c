/* zipcached: parse flags, start the server, run the loop until stopped. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>

#include <systemd/sd-daemon.h>

#include "codec_fanout.h"
#include "log.h"
#include "options.h"
#include "server.h"
#include "version.h"
#include "zipcache/codec.h"

int main(int argc, char **argv)
{
	struct options options;
	struct server server;
	int rc;

	options_default(&options);
	rc = options_parse(&options, argc, argv);
	if (rc != 0)
		return rc > 0 ? 0 : 2;
	log_set_level(options.log_level);
	/* Replies use MSG_NOSIGNAL; this covers any other write to a dead peer. */
	signal(SIGPIPE, SIG_IGN);
	zc_codec_init();

	uv_loop_t *loop = uv_default_loop();
	rc = server_start(&server, loop, &options);
	if (rc < 0)
		return 1;
	log_info("server", "listening",
		 "socket=%s mode=%04o shm_dir=%s version=%s codec=%s codec_threads=%u busy_poll_us=%u ring_poll_us=%u pool_writes=%s sessions=%zu",
		 options.socket_path, options.socket_mode, options.shm_dir, ZIPCACHE_VERSION,
		 zc_isa_name(zc_codec_isa()), codec_fanout_threads(), options.busy_poll_us,
		 server.options.ring_poll_us, pool_writes_name(server.options.pool_writes),
		 server.sessions.count);
	printf("zipcached %s listening on %s\n", ZIPCACHE_VERSION, options.socket_path);
	fflush(stdout);
	/* Under systemd (Type=notify) this is readiness; elsewhere a no-op. */
	sd_notifyf(0, "READY=1\nSTATUS=listening on %s", options.socket_path);
	uv_run(loop, UV_RUN_DEFAULT);
	server_free(&server);
	uv_loop_close(loop);
	log_info("server", "stopped", "socket=%s", options.socket_path);
	return 0;
}
