/*
 * Aligned text tables for the command-line tools.
 *
 *	static const struct table_column columns[] = {
 *		{ "ID", TABLE_RIGHT }, { "NAME", TABLE_LEFT },
 *	};
 *	struct table table;
 *
 *	table_init(&table, columns, 2);
 *	table_add(&table, "%llu", id);     one cell; rows fill left to right
 *	table_add(&table, "%s", name);
 *	rc = table_print(&table, stdout);  0, or the first error of any call
 *	table_free(&table);
 *
 * A failed table_add() is remembered, so a caller adding many cells checks
 * once, at table_print(), which then prints nothing (as ferror() does for
 * stdio). Cells are sanitised for a terminal: control characters become
 * '?', so a session name cannot move the cursor or break the alignment.
 */
#ifndef ZIPCACHE_TOOLS_TABLE_H
#define ZIPCACHE_TOOLS_TABLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

enum table_align {
	TABLE_LEFT,
	TABLE_RIGHT
};

struct table_column {
	const char *title;
	enum table_align align;
};

struct table {
	const struct table_column *columns;
	size_t n_columns;
	bool show_header;      /* default true; false for key/value listings */
	char **cells;          /* row-major, n_cells = rows * n_columns when complete */
	size_t n_cells;
	size_t capacity;
	int error;             /* first failure, sticky */
};

void table_init(struct table *table, const struct table_column *columns, size_t n_columns);

/* Appends the next cell. 0, or -ENOMEM (also kept in table->error). */
__attribute__((format(printf, 2, 3)))
int table_add(struct table *table, const char *format, ...);

/* Complete rows so far. */
size_t table_rows(const struct table *table);

/* Writes the table, columns two spaces apart, no trailing blanks. Returns
 * the first error of an earlier call, -EINVAL for an unfinished last row,
 * or -EIO when the stream failed. */
int table_print(const struct table *table, FILE *out);

void table_free(struct table *table);

#endif
