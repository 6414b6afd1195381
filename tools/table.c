/*
 * Aligned text tables (see table.h). Self-contained: every tool and test
 * links this file, so it depends on nothing but libc.
 */
#include "table.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

void table_init(struct table *table, const struct table_column *columns, size_t n_columns)
{
	memset(table, 0, sizeof(*table));
	table->columns = columns;
	table->n_columns = n_columns;
	table->show_header = true;
}

/* Control bytes (a newline or an escape sequence in a session name) would
 * break the line or drive the terminal: show them as '?'. Bytes >= 0x80
 * pass, so UTF-8 names print as written. */
static void table_sanitize(char *text)
{
	for (unsigned char *c = (unsigned char *)text; *c; c++)
		if (*c < 0x20 || *c == 0x7f)
			*c = '?';
}

/* Width in terminal columns, counting one per UTF-8 code point (its
 * continuation bytes take no column). Wide CJK glyphs are counted as one:
 * good enough for names, which are mostly ASCII. */
static size_t table_width(const char *text)
{
	size_t width = 0;

	for (const unsigned char *c = (const unsigned char *)text; *c; c++)
		if ((*c & 0xc0) != 0x80)
			width++;
	return width;
}

int table_add(struct table *table, const char *format, ...)
{
	va_list arguments;
	char *cell = NULL;
	int length;

	if (table->error)
		return table->error;
	if (table->n_cells == table->capacity) {
		size_t capacity = table->capacity ? table->capacity * 2 : 64;
		char **cells = realloc(table->cells, capacity * sizeof(*cells));

		if (!cells)
			return table->error = -ENOMEM;
		table->cells = cells;
		table->capacity = capacity;
	}
	va_start(arguments, format);
	length = vasprintf(&cell, format, arguments);
	va_end(arguments);
	if (length < 0)
		return table->error = -ENOMEM;
	table_sanitize(cell);
	table->cells[table->n_cells++] = cell;
	return 0;
}

size_t table_rows(const struct table *table)
{
	return table->n_columns ? table->n_cells / table->n_columns : 0;
}

static void table_print_cell(FILE *out, const char *text, size_t width, enum table_align align,
			     bool last)
{
	size_t pad = width - table_width(text);

	if (align == TABLE_RIGHT)
		fprintf(out, "%*s", (int)pad, "");
	fputs(text, out);
	/* Left-aligned last columns get no padding: no trailing blanks. */
	if (align == TABLE_LEFT && !last)
		fprintf(out, "%*s", (int)pad, "");
	if (!last)
		fputs("  ", out);
}

int table_print(const struct table *table, FILE *out)
{
	size_t columns = table->n_columns, rows = table_rows(table);
	size_t *widths;

	if (table->error)
		return table->error;
	if (columns == 0 || table->n_cells % columns != 0)
		return -EINVAL;
	widths = calloc(columns, sizeof(*widths));
	if (!widths)
		return -ENOMEM;
	for (size_t c = 0; c < columns; c++) {
		if (table->show_header && table->columns[c].title)
			widths[c] = table_width(table->columns[c].title);
		for (size_t r = 0; r < rows; r++) {
			size_t width = table_width(table->cells[r * columns + c]);

			if (width > widths[c])
				widths[c] = width;
		}
	}
	if (table->show_header) {
		for (size_t c = 0; c < columns; c++)
			table_print_cell(out, table->columns[c].title ? table->columns[c].title : "",
					 widths[c], table->columns[c].align, c + 1 == columns);
		fputc('\n', out);
	}
	for (size_t r = 0; r < rows; r++) {
		for (size_t c = 0; c < columns; c++)
			table_print_cell(out, table->cells[r * columns + c], widths[c],
					 table->columns[c].align, c + 1 == columns);
		fputc('\n', out);
	}
	free(widths);
	return ferror(out) ? -EIO : 0;
}

void table_free(struct table *table)
{
	for (size_t i = 0; i < table->n_cells; i++)
		free(table->cells[i]);
	free(table->cells);
	table->cells = NULL;
	table->n_cells = table->capacity = 0;
}
