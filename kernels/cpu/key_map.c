/* The global index mirror's lookup over a KeyMap (metadata/key_map.py) in one call.
 *
 * A KeyMap is one uint64 array of slots: slots[2i] a key (0 empty, 1 deleted), slots[2i + 1] its value;
 * a key's home slot is (key * multiplier) >> shift (mod 2^64), probing on linearly (mask = slots - 1).
 * Here the map is the mirror's block key -> holder set number (0: nobody).
 *
 * Along a chain the holder sets are nested (what a node holds of a chain is a prefix), so the set number
 * changes at a few positions only: equal numbers at two positions mean the same set everywhere between
 * (sets are interned). The search splits [lo, hi] only where the numbers at its ends differ: a probe per
 * step of a binary search per change, each one memory read.
 *
 * The chain is the caller's Python list of digests, read in place: the interpreter's own PyList_GetItem,
 * PyBytes_AsString and PyBytes_Size come in as function pointers (ctypes.pythonapi), so this library does
 * not link against libpython, and only the probed digests are touched. Called through ctypes.PyDLL: the
 * GIL is held, so the list and the map's array stay put for the call.
 */
#include <stdint.h>
#include <string.h>

#define KEY_EMPTY 0
#define MAX_DEPTH 128
#define MAX_GUESSES 16

typedef void *(*list_get_fn)(void *list, int64_t i);   /* PyList_GetItem: a borrowed reference */
typedef char *(*bytes_data_fn)(void *bytes);           /* PyBytes_AsString */
typedef int64_t (*bytes_size_fn)(void *bytes);         /* PyBytes_Size */

typedef struct { /* what a search reads: the map (as KeyMap lays it out) and the interpreter's accessors */
    const uint64_t *slots;
    int64_t mask, shift;
    uint64_t multiplier;
    list_get_fn get;
    bytes_data_fn data;
    bytes_size_fn size;
} search_args_t;

typedef struct {
    const search_args_t *a;
    void *list;
    int failed;
} chain_t;

static uint64_t holder_set(chain_t *c, int64_t position) {
    const search_args_t *a = c->a;
    void *digest = a->get(c->list, position);
    if (!digest || a->size(digest) < 8) {
        c->failed = 1;
        return 0;
    }
    uint64_t key;
    memcpy(&key, a->data(digest), 8); /* little-endian hosts: the block key is the digest's first 8 bytes */
    if (key < 2) key += 2;
    int64_t i = (int64_t)((key * a->multiplier) >> a->shift);
    for (;;) {
        uint64_t found = a->slots[2 * i];
        if (found == key) return a->slots[2 * i + 1];
        if (found == KEY_EMPTY) return 0;
        i = (i + 1) & a->mask;
    }
}

/* Positions where the holder set changes along the chain (a list of n digests of at least 8 bytes), as
 * pairs (position, set number) in out[2k], out[2k + 1]: position 0 with its set first, then each i with
 * set(i) != set(i - 1), ascending. `guesses` (ascending; at most MAX_GUESSES are used) are positions where
 * a change was found before, for the same first block: probing each and the block before it first, a
 * staircase that has not moved is confirmed with two probes a change, and one that has is searched only
 * where it moved. Returns how many pairs were written; -1 when more than max_out (the caller searches in
 * Python), -2 when an item is not a digest. */
int64_t key_map_holder_changes(const search_args_t *args, void *list, int64_t n, const int64_t *guesses,
                               int64_t num_guesses, int64_t *out, int64_t max_out) {
    chain_t c = {args, list, 0};
    if (n <= 0 || max_out < 1) return 0;
    int64_t points[2 * MAX_GUESSES + 2], num_points = 0;
    uint64_t point_sets[2 * MAX_GUESSES + 2];
    points[num_points++] = 0;
    for (int64_t i = 0; i < num_guesses && i < MAX_GUESSES; i++) {
        int64_t g = guesses[i];
        if (g < 1 || g > n - 1) continue;
        if (g - 1 > points[num_points - 1]) points[num_points++] = g - 1;
        if (g > points[num_points - 1]) points[num_points++] = g;
    }
    if (n - 1 > points[num_points - 1]) points[num_points++] = n - 1;
    for (int64_t i = 0; i < num_points; i++) point_sets[i] = holder_set(&c, points[i]);
    if (c.failed) return -2;
    int64_t lo_at[MAX_DEPTH], hi_at[MAX_DEPTH];
    uint64_t lo_set_at[MAX_DEPTH], hi_set_at[MAX_DEPTH];
    int64_t depth = 0, count = 1;
    out[0] = 0;
    out[1] = (int64_t)point_sets[0];
    for (int64_t i = num_points - 2; i >= 0; i--, depth++) { /* the leftmost segment on top */
        lo_at[depth] = points[i], hi_at[depth] = points[i + 1];
        lo_set_at[depth] = point_sets[i], hi_set_at[depth] = point_sets[i + 1];
    }
    while (depth) { /* left halves first: the changes come out in ascending order */
        depth--;
        int64_t lo = lo_at[depth], hi = hi_at[depth];
        uint64_t lo_set = lo_set_at[depth], hi_set = hi_set_at[depth];
        if (lo_set == hi_set) continue;
        if (hi - lo == 1) {
            if (count == max_out) return -1;
            out[2 * count] = hi;
            out[2 * count + 1] = (int64_t)hi_set;
            count++;
            continue;
        }
        if (depth + 2 > MAX_DEPTH) return -1;
        int64_t mid = lo + (hi - lo) / 2;
        uint64_t mid_set = holder_set(&c, mid);
        if (c.failed) return -2;
        lo_at[depth] = mid, hi_at[depth] = hi, lo_set_at[depth] = mid_set, hi_set_at[depth++] = hi_set;
        lo_at[depth] = lo, hi_at[depth] = mid, lo_set_at[depth] = lo_set, hi_set_at[depth++] = mid_set;
    }
    return count;
}
