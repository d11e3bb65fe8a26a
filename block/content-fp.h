/*
 * The content fingerprint shared by hybrid's inline dedup and the clone
 * cache (block/content-fp.c).  A fingerprint only finds candidates: both
 * users compare the bytes before they share a block.
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */

#ifndef BLOCK_CONTENT_FP_H
#define BLOCK_CONTENT_FP_H

/* @len must be a multiple of 32 */
uint64_t content_fingerprint(const uint8_t *buf, size_t len);

#endif
