/* The command-line tools' JSON writer (zipcachectl, zipcache-load). */
#include "json.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>


static void json_separate(struct json *json)
{
	if (json->need_comma)
		fputc(',', json->out);
	json->need_comma = false;
}

static void value_start(struct json *json, const char *key);

void json_open(struct json *json, const char *key, char bracket)
{
	value_start(json, key);
	fputc(bracket, json->out);
}

void json_close(struct json *json, char bracket)
{
	fputc(bracket, json->out);
	json->need_comma = true;
}

/* Length of the well-formed UTF-8 sequence at text (RFC 3629: no
 * overlongs, no surrogates, nothing above U+10FFFF), or 0. */
static size_t utf8_sequence(const unsigned char *text)
{
	unsigned char c = text[0];
	unsigned char low = 0x80, high = 0xbf;
	size_t length;

	if (c >= 0xc2 && c <= 0xdf)
		length = 2;
	else if (c >= 0xe0 && c <= 0xef)
		length = 3;
	else if (c >= 0xf0 && c <= 0xf4)
		length = 4;
	else
		return 0;
	if (c == 0xe0)
		low = 0xa0;
	else if (c == 0xed)
		high = 0x9f;
	else if (c == 0xf0)
		low = 0x90;
	else if (c == 0xf4)
		high = 0x8f;
	if (text[1] < low || text[1] > high)
		return 0;
	for (size_t i = 2; i < length; i++)
		if ((text[i] & 0xc0) != 0x80)
			return 0;
	return length;
}

/* A JSON string: quotes, backslashes and control characters escaped;
 * bytes that are not UTF-8 (a session name is any 64 bytes) become
 * U+FFFD, so the document stays valid JSON whatever the names hold. */
void json_string(struct json *json, const char *text)
{
	const unsigned char *c = (const unsigned char *)text;

	json_separate(json);
	fputc('"', json->out);
	while (*c) {
		if (*c == '"' || *c == '\\') {
			fputc('\\', json->out);
			fputc(*c++, json->out);
		} else if (*c == '\n') {
			fputs("\\n", json->out);
			c++;
		} else if (*c == '\t') {
			fputs("\\t", json->out);
			c++;
		} else if (*c < 0x20 || *c == 0x7f) {
			fprintf(json->out, "\\u%04x", *c++);
		} else if (*c < 0x80) {
			fputc(*c++, json->out);
		} else {
			size_t length = utf8_sequence(c);

			if (length == 0) {
				fputs("\\ufffd", json->out);
				c++;
			} else {
				fwrite(c, 1, length, json->out);
				c += length;
			}
		}
	}
	fputc('"', json->out);
	json->need_comma = true;
}

void json_key(struct json *json, const char *key)
{
	json_string(json, key);
	fputc(':', json->out);
	json->need_comma = false;
}

/* A value's start: its key inside an object, a comma inside an array. */
static void value_start(struct json *json, const char *key)
{
	if (key)
		json_key(json, key);
	else
		json_separate(json);
}

void json_null(struct json *json, const char *key)
{
	value_start(json, key);
	fputs("null", json->out);
	json->need_comma = true;
}

void json_uint(struct json *json, const char *key, uint64_t value)
{
	value_start(json, key);
	fprintf(json->out, "%" PRIu64, value);
	json->need_comma = true;
}

void json_int(struct json *json, const char *key, long long value)
{
	value_start(json, key);
	fprintf(json->out, "%lld", value);
	json->need_comma = true;
}

void json_bool(struct json *json, const char *key, bool value)
{
	value_start(json, key);
	fputs(value ? "true" : "false", json->out);
	json->need_comma = true;
}

/* The shortest of %.15g / %.17g that reads back as the same double, so
 * 0.2 prints as 0.2 and a script gets exactly the C API's value. JSON has
 * no NaN or Inf: those are null. */
void json_double(struct json *json, const char *key, double value)
{
	char text[64];

	value_start(json, key);
	if (!isfinite(value)) {
		fputs("null", json->out);
	} else {
		snprintf(text, sizeof(text), "%.15g", value);
		if (strtod(text, NULL) != value)
			snprintf(text, sizeof(text), "%.17g", value);
		fputs(text, json->out);
	}
	json->need_comma = true;
}

void json_text(struct json *json, const char *key, const char *value)
{
	if (key)
		json_key(json, key);
	json_string(json, value);
}
