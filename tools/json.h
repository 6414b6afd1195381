/*
 * The command-line tools' JSON writer: one document streamed to a FILE,
 * always valid whatever the strings hold (see json_string).
 *
 *	struct json json = { .out = stdout };
 *	json_open(&json, NULL, '{');
 *	json_uint(&json, "sessions", 3);
 *	json_open(&json, "layers", '[');
 *	...
 *	json_close(&json, ']');
 *	json_close(&json, '}');
 */
#ifndef ZIPCACHE_TOOLS_JSON_H
#define ZIPCACHE_TOOLS_JSON_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

/*
 * A minimal streaming JSON writer. One flag is enough to place commas: a
 * value or a key needs one when something came before it at its level; a
 * key clears the flag for its value, and closing a container sets it.
 */
struct json {
	FILE *out;
	bool need_comma;
};

/* Opens an object ('{') or array ('['), as the value of key when key is
 * not NULL. */
void json_open(struct json *json, const char *key, char bracket);
void json_close(struct json *json, char bracket);

/* A string value; quotes, backslashes and control characters escaped,
 * bytes that are not UTF-8 written as U+FFFD. */
void json_string(struct json *json, const char *text);
void json_key(struct json *json, const char *key);

/* Values: key names the member inside an object; NULL inside an array. */
void json_null(struct json *json, const char *key);
void json_uint(struct json *json, const char *key, uint64_t value);
void json_int(struct json *json, const char *key, long long value);
void json_bool(struct json *json, const char *key, bool value);
/* The shortest text that reads back as the same double; NaN/Inf are null. */
void json_double(struct json *json, const char *key, double value);
void json_text(struct json *json, const char *key, const char *value);

#endif
