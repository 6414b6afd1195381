/*
 * zipcached's configuration: --config FILE (`flag-name = value` lines,
 * `#` comments, blank lines), the command line overriding the file, the
 * errors a bad file gets (exit status 2 and a message naming FILE:LINE),
 * and --help.
 *
 * The daemon is started here rather than with tests/daemon_harness.c:
 * the harness always passes --socket and --shm-dir on the command line,
 * which would hide the settings under test in the file. Every daemon and
 * program runs bounded in time and dies with the test process
 * (PR_SET_PDEATHSIG); each test works in its own temporary directory,
 * removed by the runner even when an assertion fails.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <time.h>
#include <unistd.h>

#include "process_run.h"
#include "zipcache/client.h"
#include "zipcache/error.h"
#include "suite_main.h"

/* Generous for ASan; a healthy run of every test takes a second or two. */
#define TEST_TIMEOUT_SECONDS 60

/* A daemon that has not opened its socket by then is not going to. */
#define START_TIMEOUT_MS 10000

/* The daemon gives in-flight work 10 s on SIGTERM; past 20 s it is stuck. */
#define STOP_TIMEOUT_MS 20000

/* A refused configuration exits at once; this is far beyond that. */
#define EXIT_TIMEOUT_MS 5000

#define CLIENT_TIMEOUT_MS 20000

#define OUTPUT_BYTES 8192

/* ---- time and files ------------------------------------------------------------ */

static const char *daemon_binary(void)
{
	static char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/bin/zipcached", build_dir());
	return path;
}

/*
 * Every test's files live under one directory per test case, made and
 * removed by the runner process (an unchecked fixture): a failed
 * assertion ends a forked test with _exit(), past any atexit hook or
 * checked teardown, so only the runner can clean up reliably.
 */
static char base_dir[64];

static void base_dir_make(void)
{
	snprintf(base_dir, sizeof(base_dir), "/tmp/zc_config.XXXXXX");
	if (!mkdtemp(base_dir)) {
		fprintf(stderr, "config_test: mkdtemp: %s\n", strerror(errno));
		base_dir[0] = '\0';
	}
}

static void base_dir_remove(void)
{
	directory_remove(base_dir);
	base_dir[0] = '\0';
}

/* The test's private directory, inside the base (short: socket paths
 * must fit sun_path). */
static char test_dir[96];

static const char *test_dir_make(void)
{
	ck_assert_msg(base_dir[0] != '\0', "no base directory");
	snprintf(test_dir, sizeof(test_dir), "%s/t.XXXXXX", base_dir);
	ck_assert_msg(mkdtemp(test_dir) != NULL, "mkdtemp: %s", strerror(errno));
	return test_dir;
}

/* test_dir/name into out. */
static char *in_dir(char *out, size_t size, const char *name)
{
	int n = snprintf(out, size, "%s/%s", test_dir, name);
	ck_assert_msg(n > 0 && (size_t)n < size, "path too long: %s/%s", test_dir, name);
	return out;
}

/* Writes a file of the formatted text. */
static void file_write(const char *path, const char *format, ...)
	__attribute__((format(printf, 2, 3)));

static void file_write(const char *path, const char *format, ...)
{
	va_list args;
	FILE *file = fopen(path, "w");
	ck_assert_msg(file != NULL, "cannot write %s: %s", path, strerror(errno));
	va_start(args, format);
	vfprintf(file, format, args);
	va_end(args);
	ck_assert(fclose(file) == 0);
}

static bool path_exists(const char *path)
{
	struct stat st;
	return stat(path, &st) == 0;
}

static void file_read(const char *path, char *out, size_t size)
{
	FILE *file = fopen(path, "r");
	size_t n = 0;
	if (file) {
		n = fread(out, 1, size - 1, file);
		fclose(file);
	}
	out[n] = '\0';
}

/* ---- running zipcached --------------------------------------------------------- */

struct daemon {
	pid_t pid;
	char log_path[PATH_MAX];
};

#define MAX_DAEMON_ARGS 64

/* argv with argv[0] replaced by the daemon binary, into args. */
static void daemon_args(const char *const *argv, const char *args[MAX_DAEMON_ARGS])
{
	int argc = 0;

	args[argc++] = daemon_binary();
	for (int i = 1; argv[i]; i++) {
		ck_assert(argc < MAX_DAEMON_ARGS - 1);
		args[argc++] = argv[i];
	}
	args[argc] = NULL;
}

/* Forks zipcached with argv (argv[0] is replaced by the binary), its
 * stdout and stderr into log_path. */
static pid_t spawn(const char *const *argv, const char *log_path)
{
	const char *args[MAX_DAEMON_ARGS];

	daemon_args(argv, args);
	ck_assert_msg(access(args[0], X_OK) == 0, "no daemon binary at %s", args[0]);
	return program_spawn(args, log_path, log_path, NULL, NULL);
}

/* Starts the daemon and waits (bounded) until socket_path accepts. */
static void daemon_run(struct daemon *d, const char *const *argv, const char *socket_path)
{
	char log[OUTPUT_BYTES];
	static int runs;

	snprintf(d->log_path, sizeof(d->log_path), "%s/daemon-%d.log", test_dir, runs++);
	d->pid = spawn(argv, d->log_path);
	int64_t deadline = now_ms() + START_TIMEOUT_MS;
	for (;;) {
		int status;
		if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
			d->pid = 0;
			file_read(d->log_path, log, sizeof(log));
			ck_abort_msg("zipcached exited during start-up (status 0x%x); log:\n%s", status, log);
		}
		if (socket_accepts(socket_path))
			return;
		if (now_ms() > deadline) {
			kill(d->pid, SIGKILL);
			waitpid(d->pid, NULL, 0);
			d->pid = 0;
			file_read(d->log_path, log, sizeof(log));
			ck_abort_msg("zipcached did not accept on %s within %d ms; log:\n%s", socket_path,
				     START_TIMEOUT_MS, log);
		}
		sleep_ms(5);
	}
}

/* SIGTERM; asserts exit status 0 (bounded). */
static void daemon_end(struct daemon *d)
{
	char log[OUTPUT_BYTES];
	int status = 0;
	int64_t deadline = now_ms() + STOP_TIMEOUT_MS;

	ck_assert(d->pid > 0);
	kill(d->pid, SIGTERM);
	while (waitpid(d->pid, &status, WNOHANG) == 0) {
		if (now_ms() > deadline) {
			kill(d->pid, SIGKILL);
			waitpid(d->pid, &status, 0);
			d->pid = 0;
			ck_abort_msg("zipcached ignored SIGTERM for %d ms", STOP_TIMEOUT_MS);
		}
		sleep_ms(5);
	}
	d->pid = 0;
	file_read(d->log_path, log, sizeof(log));
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "zipcached should exit 0 on SIGTERM, got status 0x%x; log:\n%s", status, log);
}

/*
 * Runs zipcached with argv to its exit (bounded: a daemon that starts
 * instead of exiting is killed after EXIT_TIMEOUT_MS and reported as
 * status -1). Its stdout and stderr go into out and err.
 */
static int run_to_exit(const char *const *argv, char *out, char *err)
{
	char out_path[PATH_MAX], err_path[PATH_MAX];
	static int runs;
	int status = 0;

	snprintf(out_path, sizeof(out_path), "%s/run-%d.out", test_dir, runs);
	snprintf(err_path, sizeof(err_path), "%s/run-%d.err", test_dir, runs++);
	/* stdout and stderr apart, unlike spawn()'s one log. */
	const char *args[MAX_DAEMON_ARGS];
	daemon_args(argv, args);
	pid_t pid = program_spawn(args, out_path, err_path, NULL, NULL);
	int64_t deadline = now_ms() + EXIT_TIMEOUT_MS;
	bool killed = false;
	while (waitpid(pid, &status, WNOHANG) == 0) {
		if (now_ms() > deadline) {
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
			killed = true;
			break;
		}
		sleep_ms(5);
	}
	file_read(out_path, out, OUTPUT_BYTES);
	file_read(err_path, err, OUTPUT_BYTES);
	if (killed)
		return -1;
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static bool tcp_accepts(uint16_t port, int timeout_ms)
{
	struct sockaddr_in address = { .sin_family = AF_INET, .sin_port = htons(port) };
	int64_t deadline = now_ms() + timeout_ms;
	address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	for (;;) {
		int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		bool ok = connect(fd, (struct sockaddr *)&address, sizeof(address)) == 0;
		close(fd);
		if (ok)
			return true;
		if (now_ms() > deadline)
			return false;
		sleep_ms(10);
	}
}

/* ---- client helpers ---------------------------------------------------------------- */

static zc_client *client_connect(const char *socket_path)
{
	zc_client *client = NULL;
	int rc = zc_client_connect(socket_path, CLIENT_TIMEOUT_MS, &client);
	ck_assert_msg(rc == 0, "connect %s: %s", socket_path, zc_strerror(rc));
	return client;
}

static int session_try_open(zc_client *client, const char *name, zc_session **out)
{
	zc_session_config config;
	zc_session_config_default(&config);
	config.name = name;
	config.layers = 1;
	config.batch = 1;
	config.kv_heads = 1;
	config.head_dim_k = config.head_dim_v = 32;
	config.max_tokens = 64;
	*out = NULL;
	return zc_session_open(client, &config, out);
}

static size_t session_count(zc_client *client)
{
	zc_session_info infos[8];
	size_t count = 0;
	int rc = zc_client_list_sessions(client, infos, 8, &count);
	ck_assert_msg(rc == 0, "list sessions: %s", zc_strerror(rc));
	return count;
}

/* ---- the file takes effect ------------------------------------------------------- */

START_TEST(test_config_file_takes_effect)
{
	char config[PATH_MAX], socket_path[PATH_MAX], shm[PATH_MAX], log[OUTPUT_BYTES];
	struct daemon d;

	test_dir_make();
	in_dir(config, sizeof(config), "zipcached.conf");
	in_dir(socket_path, sizeof(socket_path), "from-file.sock");
	in_dir(shm, sizeof(shm), "shm-from-file");
	/* Comments, blank and white lines, tabs, spaces or none around '=',
	 * a CRLF line, and a last line without its newline. */
	file_write(config,
		   "# zipcached test configuration\n"
		   "\n"
		   "   # an indented comment = with an equals sign\n"
		   "socket = %s\n"
		   "\t \n"
		   "shm-dir=%s\n"
		   "\tmax-sessions\t=\t1\t\n"
		   "log-level = debug\r\n"
		   "metrics-listen = off\n"
		   "#max-sessions = 50\n"
		   "no-adopt = true",
		   socket_path, shm);
	const char *argv[] = { "zipcached", "--config", config, NULL };
	daemon_run(&d, argv, socket_path);

	struct stat st;
	ck_assert_msg(stat(shm, &st) == 0 && S_ISDIR(st.st_mode), "the shm-dir of the file, %s, is not there",
		      shm);

	zc_client *client = client_connect(socket_path);
	ck_assert_uint_eq(zc_client_server_info(client)->max_sessions, 1);
	zc_session *first, *second;
	int rc = session_try_open(client, "first", &first);
	ck_assert_msg(rc == 0, "first session: %s", zc_strerror(rc));
	rc = session_try_open(client, "second", &second);
	ck_assert_msg(rc == ZC_EEXHAUSTED, "a second session with max-sessions = 1: %s, want ZC_EEXHAUSTED",
		      zc_strerror(rc));
	ck_assert_int_eq(zc_session_close(first), 0);
	/* Closing the one session makes room again. */
	rc = session_try_open(client, "third", &second);
	ck_assert_msg(rc == 0, "a session after closing the first: %s", zc_strerror(rc));
	ck_assert_int_eq(zc_session_close(second), 0);
	zc_client_close(client);

	ck_assert_msg(process_tcp_sockets(d.pid) == 0,
		      "zipcached holds a TCP socket with metrics-listen = off in its file");
	/* Debug lines are only there at log-level debug; give the daemon a
	 * moment to write them. */
	sleep_ms(100);
	file_read(d.log_path, log, sizeof(log));
	ck_assert_msg(strstr(log, "level=debug") != NULL, "no debug lines with log-level = debug; log:\n%s",
		      log);
	daemon_end(&d);
	ck_assert_msg(!path_exists(socket_path), "the socket %s is left behind", socket_path);
}
END_TEST

/* no-adopt = true: the session files of an earlier run are deleted, not
 * adopted (the control run without it shows they would be adopted). */
START_TEST(test_config_no_adopt)
{
	char config[PATH_MAX], socket_path[PATH_MAX], shm[PATH_MAX];
	struct daemon d;

	test_dir_make();
	in_dir(config, sizeof(config), "no-adopt.conf");
	in_dir(socket_path, sizeof(socket_path), "z.sock");
	in_dir(shm, sizeof(shm), "shm");
	const char *plain[] = { "zipcached", "--socket", socket_path, "--shm-dir", shm,
				"--metrics-listen", "off", NULL };

	/* A session that outlives its daemon. */
	daemon_run(&d, plain, socket_path);
	zc_client *client = client_connect(socket_path);
	zc_session *session;
	ck_assert_int_eq(session_try_open(client, "keeper", &session), 0);
	zc_session_release(session);
	zc_client_close(client);
	daemon_end(&d);

	/* Without the setting, the next daemon adopts it. */
	daemon_run(&d, plain, socket_path);
	client = client_connect(socket_path);
	ck_assert_msg(session_count(client) == 1, "the session was not adopted by default");
	zc_client_close(client);
	daemon_end(&d);

	/* With it, it is gone. */
	file_write(config, "no-adopt = true\nsocket = %s\nshm-dir = %s\nmetrics-listen = off\n",
		   socket_path, shm);
	const char *with_file[] = { "zipcached", "--config", config, NULL };
	daemon_run(&d, with_file, socket_path);
	client = client_connect(socket_path);
	ck_assert_msg(session_count(client) == 0, "no-adopt = true in the file, yet the session is there");
	zc_client_close(client);
	daemon_end(&d);

	/* "yes" and "1" mean the same. */
	file_write(config, "no-adopt = yes\nsocket = %s\nshm-dir = %s\nmetrics-listen = off\n",
		   socket_path, shm);
	daemon_run(&d, with_file, socket_path);
	daemon_end(&d);
	file_write(config, "no-adopt=1\nsocket = %s\nshm-dir = %s\nmetrics-listen = off\n",
		   socket_path, shm);
	daemon_run(&d, with_file, socket_path);
	daemon_end(&d);
}
END_TEST

/* metrics-listen in the file opens the endpoint there. */
START_TEST(test_config_metrics_listen)
{
	char config[PATH_MAX], socket_path[PATH_MAX], shm[PATH_MAX];
	struct daemon d;
	uint16_t port = free_tcp_port();

	test_dir_make();
	in_dir(config, sizeof(config), "metrics.conf");
	in_dir(socket_path, sizeof(socket_path), "z.sock");
	in_dir(shm, sizeof(shm), "shm");
	file_write(config, "metrics-listen = 127.0.0.1:%u\nsocket = %s\nshm-dir = %s\n", port,
		   socket_path, shm);
	const char *argv[] = { "zipcached", "--config", config, NULL };
	daemon_run(&d, argv, socket_path);
	ck_assert_msg(tcp_accepts(port, 10000), "nothing listens on 127.0.0.1:%u from the file", port);
	daemon_end(&d);
}
END_TEST

/* ---- the command line wins --------------------------------------------------------- */

static void overrides_check(bool config_last)
{
	char config[PATH_MAX], file_socket[PATH_MAX], cli_socket[PATH_MAX], shm[PATH_MAX];
	char listen_arg[64];
	struct daemon d;
	uint16_t port = free_tcp_port();

	test_dir_make();
	in_dir(config, sizeof(config), "override.conf");
	in_dir(file_socket, sizeof(file_socket), "file.sock");
	in_dir(cli_socket, sizeof(cli_socket), "cli.sock");
	in_dir(shm, sizeof(shm), "shm");
	snprintf(listen_arg, sizeof(listen_arg), "127.0.0.1:%u", port);
	file_write(config,
		   "socket = %s\n"
		   "shm-dir = %s\n"
		   "max-sessions = 1\n"
		   "metrics-listen = off\n",
		   file_socket, shm);
	const char *first[] = { "zipcached", "--config", config, "--socket", cli_socket,
				"--max-sessions", "3", "--metrics-listen", listen_arg, NULL };
	const char *last[] = { "zipcached", "--socket", cli_socket, "--max-sessions", "3",
			       "--metrics-listen", listen_arg, "--config", config, NULL };
	daemon_run(&d, config_last ? last : first, cli_socket);

	ck_assert_msg(!path_exists(file_socket), "the file's socket %s exists: the file won",
		      file_socket);
	zc_client *client = client_connect(cli_socket);
	ck_assert_uint_eq(zc_client_server_info(client)->max_sessions, 3);
	zc_session *sessions[4];
	for (int i = 0; i < 3; i++) {
		char name[16];
		snprintf(name, sizeof(name), "s%d", i);
		int rc = session_try_open(client, name, &sessions[i]);
		ck_assert_msg(rc == 0, "session %d of --max-sessions 3: %s", i + 1, zc_strerror(rc));
	}
	ck_assert_int_eq(session_try_open(client, "s3", &sessions[3]), ZC_EEXHAUSTED);
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(zc_session_close(sessions[i]), 0);
	zc_client_close(client);
	/* The file said off; the command line gave an address. */
	ck_assert_msg(tcp_accepts(port, 10000), "--metrics-listen %s did not override the file's off",
		      listen_arg);
	daemon_end(&d);
}

START_TEST(test_config_command_line_overrides)
{
	overrides_check(false);
}
END_TEST

START_TEST(test_config_command_line_overrides_config_last)
{
	overrides_check(true);
}
END_TEST

/* Two --config files: read in order, so the later one wins. */
START_TEST(test_config_two_files)
{
	char one[PATH_MAX], two[PATH_MAX], socket_path[PATH_MAX], shm[PATH_MAX];
	struct daemon d;

	test_dir_make();
	in_dir(one, sizeof(one), "one.conf");
	in_dir(two, sizeof(two), "two.conf");
	in_dir(socket_path, sizeof(socket_path), "z.sock");
	in_dir(shm, sizeof(shm), "shm");
	file_write(one, "socket = %s\nshm-dir = %s\nmax-sessions = 5\nmetrics-listen = off\n",
		   socket_path, shm);
	file_write(two, "max-sessions = 2\n# a later setting of the same flag wins\nmax-sessions = 4\n");
	const char *argv[] = { "zipcached", "--config", one, "--config", two, NULL };
	daemon_run(&d, argv, socket_path);
	zc_client *client = client_connect(socket_path);
	ck_assert_uint_eq(zc_client_server_info(client)->max_sessions, 4);
	zc_client_close(client);
	daemon_end(&d);
}
END_TEST

/* Sizes with suffixes, and a value that contains '=' (only the first
 * '=' separates). */
START_TEST(test_config_values)
{
	char config[PATH_MAX], socket_path[PATH_MAX], shm[PATH_MAX];
	struct daemon d;

	test_dir_make();
	in_dir(config, sizeof(config), "values.conf");
	in_dir(socket_path, sizeof(socket_path), "a=b.sock");
	in_dir(shm, sizeof(shm), "shm");
	file_write(config,
		   "socket = %s\n"
		   "shm-dir = %s\n"
		   "metrics-listen = off\n"
		   "max-frame-bytes = 2M\n"
		   "max-inline-bytes = 64k\n"
		   "memory-budget = 1G\n"
		   "socket-mode = 0600\n",
		   socket_path, shm);
	const char *argv[] = { "zipcached", "--config", config, NULL };
	daemon_run(&d, argv, socket_path);
	zc_client *client = client_connect(socket_path);
	const zc_server_info *info = zc_client_server_info(client);
	ck_assert_uint_eq(info->max_frame_bytes, 2u << 20);
	ck_assert_uint_eq(info->max_inline_bytes, 64u << 10);
	ck_assert_uint_eq(info->memory_budget_bytes, 1ull << 30);
	zc_client_close(client);
	struct stat st;
	ck_assert_int_eq(stat(socket_path, &st), 0);
	ck_assert_msg((st.st_mode & 0777) == 0600, "socket mode %04o, want 0600 from the file",
		      (unsigned)(st.st_mode & 0777));
	daemon_end(&d);
}
END_TEST

/* ---- what a bad file gets -------------------------------------------------------- */

/*
 * zipcached --config FILE (with a socket and shm-dir of its own on the
 * command line, so a daemon that wrongly starts is harmless) exits 2,
 * says "FILE:LINE" (or, with line 0, names FILE) and what is wrong, and
 * creates neither its socket nor its shm-dir.
 */
static void bad_config_check(const char *what, const char *contents, unsigned line,
			     const char *must_say)
{
	char config[PATH_MAX], socket_path[PATH_MAX], shm[PATH_MAX], where[PATH_MAX + 16];
	char out[OUTPUT_BYTES], err[OUTPUT_BYTES];

	in_dir(config, sizeof(config), "bad.conf");
	in_dir(socket_path, sizeof(socket_path), "bad.sock");
	in_dir(shm, sizeof(shm), "bad-shm");
	if (contents)
		file_write(config, "%s", contents);
	else
		unlink(config);
	const char *argv[] = { "zipcached", "--socket", socket_path, "--shm-dir", shm,
			       "--metrics-listen", "off", "--config", config, NULL };
	int status = run_to_exit(argv, out, err);
	ck_assert_msg(status == 2, "%s: exit status %d, want 2 (%s); stderr:\n%s", what, status,
		      status < 0 ? "it started and ran instead" : "refused differently", err);
	if (line)
		snprintf(where, sizeof(where), "%s:%u:", config, line);
	else
		snprintf(where, sizeof(where), "%s", config);
	ck_assert_msg(strstr(err, where) != NULL, "%s: stderr does not say '%s':\n%s", what, where, err);
	if (must_say)
		ck_assert_msg(strstr(err, must_say) != NULL, "%s: stderr does not say '%s':\n%s", what,
			      must_say, err);
	ck_assert_msg(!path_exists(socket_path), "%s: the socket was created", what);
	ck_assert_msg(!path_exists(shm), "%s: the shm-dir was created", what);
}

START_TEST(test_config_errors)
{
	test_dir_make();
	bad_config_check("unknown setting", "# fine\nmax-sessions = 2\nmax-sesions = 4\n", 3,
			 "max-sesions");
	bad_config_check("bad number", "\nmax-sessions = many\n", 2, "max-sessions");
	bad_config_check("zero sessions", "max-sessions = 0\n", 1, "max-sessions");
	bad_config_check("negative size", "memory-budget = -1\n", 1, "memory-budget");
	bad_config_check("size with trailing junk", "max-tokens = 12x\n", 1, "max-tokens");
	bad_config_check("empty value", "max-connections =\n", 1, "max-connections");
	bad_config_check("bad log level", "log-level = loud\n", 1, "log-level");
	bad_config_check("no equals sign", "# comment\n\nsocket /tmp/x.sock\n", 3, NULL);
	bad_config_check("a nested config", "config = /etc/other.conf\n", 1, "config");
	bad_config_check("help in a file", "help = true\n", 1, "help");
	bad_config_check("version in a file", "version = 1\n", 1, "version");
	bad_config_check("metrics address without a port", "metrics-listen = localhost\n", 1,
			 "metrics-listen");
	bad_config_check("no-adopt = maybe", "no-adopt = maybe\n", 1, "no-adopt");
	bad_config_check("socket-mode not octal", "socket-mode = 999\n", 1, "socket-mode");
	bad_config_check("frame limit too small", "max-frame-bytes = 100\n", 1, "max-frame-bytes");
	bad_config_check("dashes kept", "--max-sessions = 2\n", 1, NULL);
	bad_config_check("an error after good lines", "max-sessions = 2\nlog-level = info\n"
			 "\n# x\nidle-ttl = soon\n", 5, "idle-ttl");
	bad_config_check("missing file", NULL, 0, NULL);
}
END_TEST

/* A directory is not a config file: refusing it is right, starting with
 * none of its settings is not. */
START_TEST(test_config_directory_refused)
{
	char dir[PATH_MAX], socket_path[PATH_MAX], shm[PATH_MAX];
	char out[OUTPUT_BYTES], err[OUTPUT_BYTES];

	test_dir_make();
	in_dir(dir, sizeof(dir), "conf.d");
	in_dir(socket_path, sizeof(socket_path), "dir.sock");
	in_dir(shm, sizeof(shm), "dir-shm");
	ck_assert_int_eq(mkdir(dir, 0700), 0);
	const char *argv[] = { "zipcached", "--socket", socket_path, "--shm-dir", shm,
			       "--metrics-listen", "off", "--config", dir, NULL };
	int status = run_to_exit(argv, out, err);
	ck_assert_msg(status == 2,
		      "--config with a directory: exit status %d, want 2 (-1: the daemon started "
		      "and ran, ignoring the unreadable config); stderr:\n%s",
		      status, err);
	ck_assert_msg(strstr(err, dir) != NULL, "the message does not name %s:\n%s", dir, err);
}
END_TEST

/* An unreadable file is refused, naming it (not as root: root reads all). */
START_TEST(test_config_unreadable)
{
	char config[PATH_MAX], socket_path[PATH_MAX], shm[PATH_MAX];
	char out[OUTPUT_BYTES], err[OUTPUT_BYTES];

	if (geteuid() == 0) {
		fprintf(stderr, "config_test: SKIP test_config_unreadable: running as root\n");
		return;
	}
	test_dir_make();
	in_dir(config, sizeof(config), "secret.conf");
	in_dir(socket_path, sizeof(socket_path), "u.sock");
	in_dir(shm, sizeof(shm), "u-shm");
	file_write(config, "max-sessions = 2\n");
	ck_assert_int_eq(chmod(config, 0), 0);
	const char *argv[] = { "zipcached", "--socket", socket_path, "--shm-dir", shm,
			       "--metrics-listen", "off", "--config", config, NULL };
	int status = run_to_exit(argv, out, err);
	ck_assert_msg(status == 2, "unreadable config: exit status %d; stderr:\n%s", status, err);
	ck_assert_msg(strstr(err, config) != NULL, "the message does not name %s:\n%s", config, err);
}
END_TEST

/* A comment longer than the reader's line buffer is still one comment:
 * the setting after it must be read as line 3, and the file accepted. */
START_TEST(test_config_long_comment)
{
	char config[PATH_MAX], socket_path[PATH_MAX], shm[PATH_MAX];
	struct daemon d;
	size_t comment_bytes = 10000;
	char *comment = malloc(comment_bytes + 1);

	test_dir_make();
	in_dir(config, sizeof(config), "long.conf");
	in_dir(socket_path, sizeof(socket_path), "long.sock");
	in_dir(shm, sizeof(shm), "shm");
	ck_assert(comment != NULL);
	memset(comment, 'x', comment_bytes);
	comment[0] = '#';
	comment[comment_bytes] = '\0';
	file_write(config, "# a very long comment follows\n%s\nsocket = %s\nshm-dir = %s\n"
		   "metrics-listen = off\nmax-sessions = 7\n",
		   comment, socket_path, shm);
	free(comment);
	const char *argv[] = { "zipcached", "--config", config, NULL };
	daemon_run(&d, argv, socket_path);
	zc_client *client = client_connect(socket_path);
	ck_assert_uint_eq(zc_client_server_info(client)->max_sessions, 7);
	zc_client_close(client);
	daemon_end(&d);
}
END_TEST

/* A setting longer than the line buffer is refused with its own line
 * number, not misread as two lines. */
START_TEST(test_config_long_value_line_number)
{
	char out[OUTPUT_BYTES], err[OUTPUT_BYTES], config[PATH_MAX], socket_path[PATH_MAX];
	char shm[PATH_MAX], where[PATH_MAX + 16];
	size_t value_bytes = 9000;
	char *value = malloc(value_bytes + 1);

	test_dir_make();
	in_dir(config, sizeof(config), "longvalue.conf");
	in_dir(socket_path, sizeof(socket_path), "lv.sock");
	in_dir(shm, sizeof(shm), "lv-shm");
	ck_assert(value != NULL);
	memset(value, 'd', value_bytes);
	value[value_bytes] = '\0';
	file_write(config, "# line 1\nshm-dir = /tmp/%s\nmax-sessions = 3\n", value);
	free(value);
	const char *argv[] = { "zipcached", "--socket", socket_path, "--shm-dir", shm,
			       "--metrics-listen", "off", "--config", config, NULL };
	int status = run_to_exit(argv, out, err);
	ck_assert_msg(status == 2, "a 9000-byte shm-dir: exit status %d; stderr:\n%s", status, err);
	snprintf(where, sizeof(where), "%s:2:", config);
	ck_assert_msg(strstr(err, where) != NULL, "the error does not point at line 2 ('%s'):\n%s",
		      where, err);
}
END_TEST

/* ---- the command line alone -------------------------------------------------------- */

START_TEST(test_help_and_version)
{
	char out[OUTPUT_BYTES], err[OUTPUT_BYTES];

	test_dir_make();
	const char *help[] = { "zipcached", "--help", NULL };
	int status = run_to_exit(help, out, err);
	ck_assert_msg(status == 0, "--help: exit status %d; stderr:\n%s", status, err);
	ck_assert_msg(strstr(out, "--config") != NULL, "--help does not list --config:\n%s", out);
	ck_assert_msg(strstr(out, "--metrics-listen") != NULL,
		      "--help does not list --metrics-listen:\n%s", out);
	ck_assert_msg(strstr(out, "--socket") != NULL && strstr(out, "--max-sessions") != NULL,
		      "--help misses flags:\n%s", out);

	const char *version[] = { "zipcached", "--version", NULL };
	status = run_to_exit(version, out, err);
	ck_assert_msg(status == 0, "--version: exit status %d", status);
	ck_assert_msg(strncmp(out, "zipcached ", 10) == 0, "--version printed '%s'", out);
}
END_TEST

START_TEST(test_command_line_errors)
{
	char out[OUTPUT_BYTES], err[OUTPUT_BYTES], socket_path[PATH_MAX], shm[PATH_MAX];

	test_dir_make();
	in_dir(socket_path, sizeof(socket_path), "cli.sock");
	in_dir(shm, sizeof(shm), "cli-shm");
	const char *cases[][4] = {
		{ "--bogus", NULL, NULL, NULL },
		{ "--config", NULL, NULL, NULL },   /* no value */
		{ "--max-sessions", "0", NULL, NULL },
		{ "--metrics-listen", "nowhere", NULL, NULL },
		{ "--log-level", "chatty", NULL, NULL },
		{ "stray-argument", NULL, NULL, NULL },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const char *argv[16] = { "zipcached", "--socket", socket_path, "--shm-dir", shm };
		int argc = 5;
		for (int j = 0; j < 4 && cases[i][j]; j++)
			argv[argc++] = cases[i][j];
		argv[argc] = NULL;
		int status = run_to_exit(argv, out, err);
		ck_assert_msg(status == 2, "zipcached ... %s %s: exit status %d, want 2; stderr:\n%s",
			      cases[i][0], cases[i][1] ? cases[i][1] : "", status, err);
		ck_assert_msg(err[0] != '\0', "zipcached ... %s: no message", cases[i][0]);
		ck_assert_msg(!path_exists(socket_path), "zipcached ... %s: socket created", cases[i][0]);
	}
}
END_TEST

static Suite *config_suite(void)
{
	Suite *suite = suite_create("config");
	TCase *effect = tcase_create("effect");
	TCase *errors = tcase_create("errors");

	tcase_add_unchecked_fixture(effect, base_dir_make, base_dir_remove);
	tcase_set_timeout(effect, TEST_TIMEOUT_SECONDS);
	tcase_add_test(effect, test_config_file_takes_effect);
	tcase_add_test(effect, test_config_no_adopt);
	tcase_add_test(effect, test_config_metrics_listen);
	tcase_add_test(effect, test_config_command_line_overrides);
	tcase_add_test(effect, test_config_command_line_overrides_config_last);
	tcase_add_test(effect, test_config_two_files);
	tcase_add_test(effect, test_config_values);
	suite_add_tcase(suite, effect);

	tcase_add_unchecked_fixture(errors, base_dir_make, base_dir_remove);
	tcase_set_timeout(errors, TEST_TIMEOUT_SECONDS);
	tcase_add_test(errors, test_config_errors);
	tcase_add_test(errors, test_config_directory_refused);
	tcase_add_test(errors, test_config_unreadable);
	tcase_add_test(errors, test_config_long_comment);
	tcase_add_test(errors, test_config_long_value_line_number);
	tcase_add_test(errors, test_help_and_version);
	tcase_add_test(errors, test_command_line_errors);
	suite_add_tcase(suite, errors);
	return suite;
}

int main(void)
{
	signal(SIGPIPE, SIG_IGN);
	return suite_main(config_suite(), CK_FORK_GETENV);
}
