/*
 * Tests for `make install`, as a user meets it after installing.
 *
 * Each test installs the tree this suite was built from into a fresh
 * DESTDIR (PREFIX=/usr/local) with the real Makefile, and looks at what a
 * program and a Python interpreter get from there: the library under its
 * versioned name with the soname and development links, a pkg-config file
 * that a program compiles and links with, a program that then loads the
 * staged libzipcache.so.0 and runs, and the Python package importable from
 * the staged system path without pip.
 *
 * Nothing is built here: the install builds nothing when the tree is up to
 * date (make check has just built it), and each test checks that with
 * `make -q all` first rather than rebuild a tree other runs may be using.
 * The source tree is $ZC_SOURCE_DIR (make check sets it), else the current
 * directory.
 */
#include <check.h>
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "process_run.h"
#include "suite_main.h"

#define PYTHON "/usr/bin/python3"
#define STAGED_PREFIX "/usr/local"

/* Under `make asan` the installed library needs the sanitizers' runtime,
 * which must be the first library a process loads: the test program is
 * built with them too, and python3 (uninstrumented) cannot load it. */
#ifdef __SANITIZE_ADDRESS__
#define SANITIZED true
#define PROGRAM_FLAGS "-fsanitize=address,undefined"
#else
#define SANITIZED false
#define PROGRAM_FLAGS ""
#endif

static char work_dir[PATH_MAX];
static char stage[PATH_MAX + 16];     /* DESTDIR */
static char source[PATH_MAX];
static char build[PATH_MAX];          /* BUILD= for make, relative to source when inside it */

/* Runs argv (stdout and stderr into one file) and returns its status; the
 * output, malloc'd, in *output. */
static int run(const char *const *argv, char **output)
{
	char path[PATH_MAX + 16];
	struct program_output result;
	int status;

	snprintf(path, sizeof(path), "%s/output", work_dir);
	program_capture(&result, argv, path, path, NULL, NULL);
	*output = result.out;
	result.out = NULL;
	status = result.status;
	program_output_free(&result);
	return status;
}

/* /bin/sh -c script; what it printed in *output. */
static int run_shell(const char *script, char **output)
{
	const char *argv[] = { "/bin/sh", "-c", script, NULL };

	return run(argv, output);
}

/*
 * make -C SOURCE BUILD=... ARGS, with none of the calling make's state:
 * make check runs this suite from a recipe, and its MAKEFLAGS (jobserver
 * descriptors, the asan build's variables) are not this make's.
 */
static int run_make(const char *args, char **output)
{
	char script[6 * PATH_MAX];

	snprintf(script, sizeof(script),
		 "unset MAKEFLAGS MFLAGS MAKELEVEL; exec make --no-print-directory -C '%s' BUILD='%s' %s",
		 source, build, args);
	return run_shell(script, output);
}

static void staged(char *out, size_t size, const char *path)
{
	snprintf(out, size, "%s" STAGED_PREFIX "/%s", stage, path);
}

static void find_trees(void)
{
	const char *env = getenv("ZC_SOURCE_DIR");
	char makefile[PATH_MAX + 16];
	size_t length;

	ck_assert_msg(realpath(env && *env ? env : ".", source) != NULL, "source tree: %s",
		      strerror(errno));
	snprintf(makefile, sizeof(makefile), "%s/Makefile", source);
	ck_assert_msg(access(makefile, R_OK) == 0,
		      "no Makefile in %s (set ZC_SOURCE_DIR to the source tree)", source);
	ck_assert_msg(realpath(build_dir(), build) != NULL, "build directory %s: %s", build_dir(),
		      strerror(errno));
	length = strlen(source);
	if (strncmp(build, source, length) == 0 && build[length] == '/')
		memmove(build, build + length + 1, strlen(build + length + 1) + 1);
}

static void cleanup(void)
{
	directory_remove(work_dir);
	work_dir[0] = '\0';
}

/* Each test's start (fork mode: its own process, its own DESTDIR). */
static void install_staged(void)
{
	const char *base = getenv("TMPDIR");
	char args[PATH_MAX + 64];
	char *output;
	int status;

	if (!base || !*base)
		base = "/tmp";
	snprintf(work_dir, sizeof(work_dir), "%s/zc_install_test.XXXXXX", base);
	ck_assert_msg(mkdtemp(work_dir) != NULL, "mkdtemp: %s", strerror(errno));
	atexit(cleanup);
	snprintf(stage, sizeof(stage), "%s/stage", work_dir);
	find_trees();

	status = run_make("-q all", &output);
	ck_assert_msg(status == 0,
		      "make -q all in %s (BUILD=%s) says the build is not up to date (status %d); "
		      "this suite installs what was built and builds nothing:\n%s",
		      source, build, status, output);
	free(output);

	snprintf(args, sizeof(args), "DESTDIR='%s' PREFIX=" STAGED_PREFIX " install", stage);
	status = run_make(args, &output);
	ck_assert_msg(status == 0, "make install failed (status %d):\n%s", status, output);
	free(output);
}

/* The file at path is a symbolic link whose text is target. */
static void assert_link(const char *path, const char *target)
{
	char text[PATH_MAX];
	ssize_t length = readlink(path, text, sizeof(text) - 1);

	ck_assert_msg(length > 0, "%s is not a symbolic link: %s", path, strerror(errno));
	text[length] = '\0';
	ck_assert_msg(strcmp(text, target) == 0, "%s -> %s, expected -> %s", path, text, target);
}

static void assert_regular(const char *path, mode_t mode)
{
	struct stat st;

	ck_assert_msg(lstat(path, &st) == 0, "%s: %s", path, strerror(errno));
	ck_assert_msg(S_ISREG(st.st_mode), "%s is not a regular file", path);
	ck_assert_msg((st.st_mode & 07777) == mode, "%s has mode %04o, expected %04o", path,
		      (unsigned)(st.st_mode & 07777), (unsigned)mode);
}

START_TEST(test_library_links_and_files)
{
	char path[2 * PATH_MAX];
	char *pc;

	install_staged();

	staged(path, sizeof(path), "lib/libzipcache.so.0.1.0");
	assert_regular(path, 0755);
	staged(path, sizeof(path), "lib/libzipcache.so.0");
	assert_link(path, "libzipcache.so.0.1.0");
	staged(path, sizeof(path), "lib/libzipcache.so");
	assert_link(path, "libzipcache.so.0");
	staged(path, sizeof(path), "lib/libzipcache.a");
	assert_regular(path, 0644);
	for (size_t i = 0; i < 4; i++) {
		static const char *const programs[] = { "zipcached", "zipcachectl", "zipcache-tool",
							"zipcache-load" };
		char name[64];

		snprintf(name, sizeof(name), "bin/%s", programs[i]);
		staged(path, sizeof(path), name);
		assert_regular(path, 0755);
	}
	staged(path, sizeof(path), "include/zipcache/client.h");
	assert_regular(path, 0644);

	/* Written at install time, so it names the install's prefix. */
	staged(path, sizeof(path), "lib/pkgconfig/zipcache.pc");
	pc = file_read_whole(path, NULL);
	ck_assert_msg(strstr(pc, "prefix=" STAGED_PREFIX "\n") != NULL, "zipcache.pc:\n%s", pc);
	ck_assert_msg(strstr(pc, "Libs: -L${libdir} -lzipcache\n") != NULL, "zipcache.pc:\n%s", pc);
	free(pc);
}
END_TEST

/*
 * A program built as a user builds one (cc ... $(pkg-config --cflags
 * --libs zipcache)), pointed at the staged tree by pkg-config's sysroot
 * and an rpath: it must load the staged library through its soname link
 * and call into it.
 */
START_TEST(test_program_links_with_pkg_config)
{
	static const char program[] =
		"#include <stdio.h>\n"
		"#include <string.h>\n"
		"#include <zipcache/codec.h>\n"
		"#include <zipcache/error.h>\n"
		"int main(void)\n"
		"{\n"
		"\tzc_codec_config config;\n"
		"\tchar line[4096];\n"
		"\tFILE *maps = fopen(\"/proc/self/maps\", \"r\");\n"
		"\n"
		"\tzc_codec_config_default(&config);\n"
		"\tprintf(\"%s %d\\n\", zc_error_name(ZC_ENOTFOUND), zc_codec_config_validate(&config));\n"
		"\twhile (maps && fgets(line, sizeof(line), maps))\n"
		"\t\tif (strstr(line, \"libzipcache\")) {\n"
		"\t\t\tprintf(\"mapped %s\", strchr(line, '/'));\n"
		"\t\t\tbreak;\n"
		"\t\t}\n"
		"\treturn 0;\n"
		"}\n";
	char source_path[PATH_MAX + 16], binary_path[PATH_MAX + 16], lib_dir[2 * PATH_MAX];
	char script[8 * PATH_MAX], expected[3 * PATH_MAX];
	char *output;
	FILE *file;
	int status;

	install_staged();

	snprintf(source_path, sizeof(source_path), "%s/program.c", work_dir);
	snprintf(binary_path, sizeof(binary_path), "%s/program", work_dir);
	file = fopen(source_path, "w");
	ck_assert(file != NULL);
	fputs(program, file);
	ck_assert_int_eq(fclose(file), 0);
	staged(lib_dir, sizeof(lib_dir), "lib");

	snprintf(script, sizeof(script),
		 "export PKG_CONFIG_SYSROOT_DIR='%s' PKG_CONFIG_LIBDIR='%s/pkgconfig' && "
		 "flags=$(pkg-config --cflags --libs zipcache) && "
		 "exec cc " PROGRAM_FLAGS " -o '%s' '%s' $flags -Wl,-rpath,'%s'",
		 stage, lib_dir, binary_path, source_path, lib_dir);
	status = run_shell(script, &output);
	ck_assert_msg(status == 0, "compiling against the staged install failed:\n%s", output);
	free(output);

	/* No LD_LIBRARY_PATH: only the rpath and the soname link. */
	{
		const char *argv[] = { "/usr/bin/env", "-u", "LD_LIBRARY_PATH", binary_path, NULL };

		status = run(argv, &output);
	}
	snprintf(expected, sizeof(expected), "ZC_ENOTFOUND 0\nmapped %s/libzipcache.so.0.1.0\n",
		 lib_dir);
	ck_assert_msg(status == 0 && strcmp(output, expected) == 0,
		      "the program (status %d) printed:\n%s\nexpected:\n%s", status, output, expected);
	free(output);
}
END_TEST

/* The package lands on the system Python's own path for the prefix and
 * loads libzipcache.so.0 from the staged library directory. */
START_TEST(test_python_imports_installed_package)
{
	static const char script[] =
		"import sys, zipcache, zipcache._lib\n"
		"print(zipcache.__file__)\n"
		"print([l.split()[-1] for l in open('/proc/self/maps') if 'libzipcache' in l][0])\n";
	char python_dir[2 * PATH_MAX], lib_dir[2 * PATH_MAX], pythonpath[2 * PATH_MAX + 16];
	char ld_path[2 * PATH_MAX + 32], expected[5 * PATH_MAX], relative[64];
	char *output, *version;
	int status;

	if (access(PYTHON, X_OK) != 0 || SANITIZED) {
		printf("test_python_imports_installed_package: skipped (%s)\n",
		       SANITIZED ? "a sanitized library" : "no " PYTHON);
		return;
	}
	install_staged();
	{
		const char *argv[] = { PYTHON, "-c",
				       "import sys; print('%d.%d' % sys.version_info[:2], end='')",
				       NULL };

		ck_assert_int_eq(run(argv, &version), 0);
	}
	snprintf(relative, sizeof(relative), "lib/python%.16s/dist-packages", version);
	free(version);
	staged(python_dir, sizeof(python_dir), relative);
	staged(lib_dir, sizeof(lib_dir), "lib");
	snprintf(pythonpath, sizeof(pythonpath), "PYTHONPATH=%s", python_dir);
	snprintf(ld_path, sizeof(ld_path), "LD_LIBRARY_PATH=%s", lib_dir);
	{
		const char *argv[] = { "/usr/bin/env", "-u", "ZIPCACHE_LIBRARY", pythonpath,
				       ld_path, PYTHON, "-c", script, NULL };

		status = run(argv, &output);
	}
	snprintf(expected, sizeof(expected), "%s/zipcache/__init__.py\n%s/libzipcache.so.0.1.0\n",
		 python_dir, lib_dir);
	ck_assert_msg(status == 0 && strcmp(output, expected) == 0,
		      "python3 (status %d) printed:\n%s\nexpected:\n%s", status, output, expected);
	free(output);
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
		{ "staged", { test_library_links_and_files, test_program_links_with_pkg_config,
			      test_python_imports_installed_package, NULL } },
	};
	Suite *suite = suite_create("install");

	/* make -q and make install read the whole tree; a compile; python3. */
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), 120);
	return suite_main(suite, CK_FORK);
}
