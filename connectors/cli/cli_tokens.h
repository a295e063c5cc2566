/* SPDX-License-Identifier: Apache-2.0 */
/* cli_tokens: reader of token ids as text -- separated by blanks or commas,
 * or one JSON array -- the way `kvplane hash` takes them on stdin.  Used by
 * the tool, a test and a fuzzer.
 *
 * Input is untrusted: every malformed input gets one error naming where it
 * is ("stdin:1:5: token 3 \"x\" is not a token id ...").  Memory is constant
 * whatever the input's size: ids reach the caller in batches of at most
 * CLI_TOKENS_BATCH, through a callback. */
#ifndef KVP_CLI_TOKENS_H
#define KVP_CLI_TOKENS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define CLI_TOKENS_BATCH 4096u /* ids per callback, at most */

/* Takes the next n ids (1..CLI_TOKENS_BATCH) in input order; `ids` lives
 * only for the call.  Returns >= 0 to go on, or a negative value that stops
 * the reader, which then returns that value. */
typedef int (*cli_tokens_fn)(void *arg, const uint32_t *ids, size_t n);

/* Reads `f` to its end and hands every token id (decimal, 0..UINT32_MAX, no
 * sign) to fn(arg, ...).  `name` names the input in messages ("stdin").
 * Returns 0; KVP_ECORRUPT when the text is malformed, with `why` (may be NULL
 * when cap is 0) holding one line:
 *   "NAME:LINE:COL: ..."  LINE and COL 1-based, of the offending character
 *                         (a bad token's first one; its ordinal is named);
 *   "NAME: ..."           a trailing ',' or an unclosed '[' at end of input
 *                         (the tool printed these without a position);
 * or fn's negative value, `why` saying at which token it stopped.  Ids before
 * an error may already have reached fn: a caller discards them on failure.
 * A read error of `f` returns -EIO (`why` says after which token): a
 * truncated read must not be hashed as if it were the whole prompt.
 * Reentrant: no state outside the call. */
int cli_tokens_read(FILE *f, const char *name, cli_tokens_fn fn, void *arg,
                    char *why, size_t cap);

#endif /* KVP_CLI_TOKENS_H */
