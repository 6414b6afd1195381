/*
 * The fuzz target's inputs in `make check`: every file in fuzz/regressions
 * (inputs that once crashed, hung or drew a wrong reply from the daemon;
 * see fuzz/README.md) and every seed in fuzz/corpus goes through
 * fuzz/dispatch_fuzz.c's entry points, compiled here by the project's own
 * compiler (and sanitizers under `make asan`) instead of clang's libFuzzer.
 *
 * The target checks each reply itself and abort()s on anything wrong,
 * naming the file; each file is its own test (a Check loop test, forked),
 * so a failure shows as that iteration dying on SIGABRT.
 * Files are read relative to the source tree: $ZC_SOURCE_DIR, or the
 * current directory (make check runs from the top of the tree).
 */
#include <check.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../fuzz/dispatch_fuzz.c"

/* Per file: one daemon start and a few dozen requests at most, but ASan
 * makes the codec several times slower. */
#define TEST_TIMEOUT_SECONDS 60

/* The files to replay, listed in main() before Check forks a test. */
struct file_list {
	char dir[PATH_MAX];
	char **names;
	size_t count;
};

static struct file_list regressions, seeds;

static const char *source_dir(void)
{
	const char *dir = getenv("ZC_SOURCE_DIR");
	return dir && *dir ? dir : ".";
}

static int name_compare(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

/*
 * Lists the regular files of SOURCE/subdir in name order, dot files (such
 * as .gitkeep) aside. A directory that cannot be read leaves the list
 * empty; the tests then say so.
 */
static void file_list_load(struct file_list *list, const char *subdir)
{
	struct dirent *entry;
	size_t cap = 0;
	DIR *dir;

	snprintf(list->dir, sizeof(list->dir), "%s/%s", source_dir(), subdir);
	dir = opendir(list->dir);
	if (!dir)
		return;
	while ((entry = readdir(dir))) {
		char path[PATH_MAX + 256];
		struct stat st;

		snprintf(path, sizeof(path), "%s/%s", list->dir, entry->d_name);
		if (entry->d_name[0] == '.' || stat(path, &st) < 0 || !S_ISREG(st.st_mode))
			continue;
		if (list->count == cap) {
			cap = cap ? cap * 2 : 64;
			char **names = realloc(list->names, cap * sizeof(*names));
			if (!names)
				abort();
			list->names = names;
		}
		list->names[list->count] = strdup(entry->d_name);
		if (!list->names[list->count])
			abort();
		list->count++;
	}
	closedir(dir);
	if (list->count > 0)
		qsort(list->names, list->count, sizeof(*list->names), name_compare);
}

static void file_list_free(struct file_list *list)
{
	for (size_t i = 0; i < list->count; i++)
		free(list->names[i]);
	free(list->names);
	memset(list, 0, sizeof(*list));
}

/* Reads a whole file into a malloc'd buffer (NULL for an empty file). */
static uint8_t *file_read(const char *path, size_t *size)
{
	FILE *f = fopen(path, "rb");
	uint8_t *data = NULL;
	long length;

	ck_assert_msg(f != NULL, "cannot open %s", path);
	ck_assert_int_eq(fseek(f, 0, SEEK_END), 0);
	length = ftell(f);
	ck_assert_msg(length >= 0, "cannot size %s", path);
	rewind(f);
	*size = (size_t)length;
	if (length > 0) {
		data = malloc((size_t)length);
		ck_assert_ptr_nonnull(data);
		ck_assert_msg(fread(data, 1, (size_t)length, f) == (size_t)length, "cannot read %s", path);
	}
	fclose(f);
	return data;
}

/* One file through the target, in this test's own process (and daemon). */
static void replay(const struct file_list *list, size_t index)
{
	char path[PATH_MAX + 256];
	uint8_t *data;
	size_t size;

	snprintf(path, sizeof(path), "%s/%s", list->dir, list->names[index]);
	data = file_read(path, &size);
	LLVMFuzzerInitialize(NULL, NULL);
	fuzz.label = path;
	LLVMFuzzerTestOneInput(data, size);
	fuzz.label = NULL;
	fuzz_target_teardown();
	free(data);
}

/* Each file is a test of its own (a loop test), so one failure names its
 * file and does not hide the others. */
START_TEST(regression_replays)
{
	replay(&regressions, (size_t)_i);
}
END_TEST

START_TEST(seed_replays)
{
	replay(&seeds, (size_t)_i);
}
END_TEST

START_TEST(directories_found)
{
	struct stat st;

	ck_assert_msg(stat(regressions.dir, &st) == 0 && S_ISDIR(st.st_mode),
		      "no %s (run from the top of the tree or set ZC_SOURCE_DIR)", regressions.dir);
	/* An empty seed corpus would make the seed tests pass for nothing. */
	ck_assert_msg(seeds.count >= 10, "%zu seeds in %s, expected a few dozen", seeds.count,
		      seeds.dir);
}
END_TEST

/* The empty input and a lone partial header: the target's smallest cases. */
START_TEST(trivial_inputs)
{
	static const uint8_t partial[] = { 0x05, 0x00 };

	LLVMFuzzerInitialize(NULL, NULL);
	LLVMFuzzerTestOneInput(NULL, 0);
	LLVMFuzzerTestOneInput(partial, sizeof(partial));
	fuzz_target_teardown();
}
END_TEST

static Suite *fuzz_regressions_suite(void)
{
	Suite *suite = suite_create("fuzz_regressions");
	TCase *tc = tcase_create("replay");

	tcase_set_timeout(tc, TEST_TIMEOUT_SECONDS);
	tcase_add_test(tc, directories_found);
	tcase_add_test(tc, trivial_inputs);
	tcase_add_loop_test(tc, regression_replays, 0, (int)regressions.count);
	tcase_add_loop_test(tc, seed_replays, 0, (int)seeds.count);
	suite_add_tcase(suite, tc);
	return suite;
}

int main(void)
{
	SRunner *runner;
	int failed;

	file_list_load(&regressions, "fuzz/regressions");
	file_list_load(&seeds, "fuzz/corpus");
	runner = srunner_create(fuzz_regressions_suite());
	srunner_run_all(runner, CK_NORMAL);
	failed = srunner_ntests_failed(runner);
	srunner_free(runner);
	file_list_free(&regressions);
	file_list_free(&seeds);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
