/* siphash.h -- SipHash, the keyed hash of the cold arena's index.
 *
 * A hash table that clients fill with keys of their choosing needs a hash
 * whose collisions they cannot predict: with an unkeyed or merely seeded
 * hash (MurmurHash64A, which the arena used before) one can compute many keys
 * that land in one probe chain, for any seed, and every lookup then walks
 * the chain (hash flooding). SipHash is a pseudo-random function of a
 * 128-bit secret key: without the key, colliding keys cannot be chosen.
 *
 * sipHash12() is SipHash-1-2 (one compression round per 8-byte word, two
 * finalisation rounds), the variant Redis's dict uses (src/siphash.c) for
 * the same reason, at about the cost of MurmurHash2; sipHash24() is the
 * standard SipHash-2-4, here so that the tests can check the code against
 * the published test vectors. No Redis dependency.
 */
#ifndef HYBRIDMEM_SIPHASH_H
#define HYBRIDMEM_SIPHASH_H

#include <stddef.h>
#include <stdint.h>

#define SIPHASH_KEY_BYTES 16

/* The key as the two little-endian 64-bit words of its 16 bytes. */
typedef struct SipKey {
    uint64_t k0, k1;
} SipKey;

/* Load a key from its 16 bytes (the byte order of the reference code). */
SipKey sipKeyFromBytes(const uint8_t key[SIPHASH_KEY_BYTES]);

uint64_t sipHash12(const SipKey *key, const void *in, size_t len);
uint64_t sipHash24(const SipKey *key, const void *in, size_t len);

#endif
