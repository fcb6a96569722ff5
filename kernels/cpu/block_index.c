/* The block pool's digest -> block id table (kvmesh/kv/block_index.py): open addressing, linear probing.
 *
 *   keys  uint64[2 * num_slots]   slot s holds a 16-byte digest as keys[2s] (bytes 0-7), keys[2s+1] (8-15)
 *   vals  int32[num_slots]        slot s's block id, EMPTY (-1) for a free slot
 *
 * num_slots is a power of two (mask = num_slots - 1) at least twice the pool's blocks: a block holds at
 * most one digest, so the table is never more than half full and never grows. A digest's home slot is
 * its first eight bytes masked (digests are BLAKE2b output: uniform already). Removal moves the entries
 * behind the freed slot back (backward-shift deletion), so there are no tombstones and probes stay short.
 *
 * block_index_chain walks the pool's parent links (int32[num_blocks]) back from a chain's last block:
 * what a match returns, without one lookup per block.
 *
 * The memory is the caller's (numpy and array buffers). The Python side loads these through
 * ctypes.PyDLL, so each call runs holding the GIL: one call is atomic for Python threads.
 */
#include <stdint.h>
#include <string.h>

#define EMPTY (-1)

typedef struct {
    uint64_t lo, hi;
} digest_t;

static inline digest_t load_digest(const uint8_t *p) {
    digest_t d;
    memcpy(&d.lo, p, 8);
    memcpy(&d.hi, p + 8, 8);
    return d;
}

/* The slot holding `d`, else the empty slot where its probe ends (negative-encoded as -(slot + 1)). */
static inline int64_t probe(const uint64_t *keys, const int32_t *vals, int64_t mask, digest_t d) {
    int64_t s = (int64_t)(d.lo & (uint64_t)mask);
    while (vals[s] != EMPTY) {
        if (keys[2 * s] == d.lo && keys[2 * s + 1] == d.hi) return s;
        s = (s + 1) & mask;
    }
    return -(s + 1);
}

/* The block holding `digest`, or -1. */
int64_t block_index_find(const uint64_t *keys, const int32_t *vals, int64_t mask, const uint8_t *digest) {
    int64_t s = probe(keys, vals, mask, load_digest(digest));
    return s >= 0 ? vals[s] : -1;
}

/* The blocks of the chain that ends at block `last`, `length` long: out[length - 1] = last and
 * out[i - 1] = parents[out[i]] (the pool's parent links, NO_BLOCK (-1) above a root). Returns 1 when
 * they are consecutive ascending ids, 0 when not, -1 when the chain is shorter than `length`. */
int64_t block_index_chain(const int32_t *parents, int64_t last, int64_t length, int32_t *out) {
    int64_t block = last, consecutive = 1;
    for (int64_t i = length - 1; i >= 0; i--) {
        if (block < 0) return -1;
        out[i] = (int32_t)block;
        if (i + 1 < length && out[i + 1] != block + 1) consecutive = 0;
        block = parents[block];
    }
    return consecutive;
}

/* Remove `digest`; returns the block that held it, or -1 when it was not there. */
int64_t block_index_remove(uint64_t *keys, int32_t *vals, int64_t mask, const uint8_t *digest) {
    int64_t hole = probe(keys, vals, mask, load_digest(digest));
    if (hole < 0) return -1;
    int64_t removed = vals[hole];
    for (int64_t s = (hole + 1) & mask; vals[s] != EMPTY; s = (s + 1) & mask) {
        int64_t home = (int64_t)(keys[2 * s] & (uint64_t)mask);
        /* the entry at s may fill the hole unless its home lies cyclically in (hole, s] */
        int stays = hole <= s ? (hole < home && home <= s) : (hole < home || home <= s);
        if (stays) continue;
        keys[2 * hole] = keys[2 * s];
        keys[2 * hole + 1] = keys[2 * s + 1];
        vals[hole] = vals[s];
        hole = s;
    }
    vals[hole] = EMPTY;
    return removed;
}

/* Add n digests, all or none: digest i goes to block_ids[i] (or first_block + i when block_ids is NULL).
 * Returns -1 once all are added; else the position of the first digest already present (or repeated
 * within the run), and what this call added is taken back out. */
int64_t block_index_add_run(uint64_t *keys, int32_t *vals, int64_t mask, const uint8_t *digests, int64_t n,
                            const int32_t *block_ids, int64_t first_block) {
    for (int64_t i = 0; i < n; i++) {
        digest_t d = load_digest(digests + 16 * i);
        int64_t s = probe(keys, vals, mask, d);
        if (s >= 0) {
            for (int64_t j = 0; j < i; j++) block_index_remove(keys, vals, mask, digests + 16 * j);
            return i;
        }
        s = -s - 1;
        keys[2 * s] = d.lo;
        keys[2 * s + 1] = d.hi;
        vals[s] = (int32_t)(block_ids ? block_ids[i] : first_block + i);
    }
    return -1;
}
