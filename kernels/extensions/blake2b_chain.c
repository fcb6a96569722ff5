/* kvmesh_blake2b_chain: the chained block hash of docs/design.md §4 in C (a CPython extension).
 *
 *   h[i] = BLAKE2b(h[i-1] || data[i * step : (i + 1) * step], 16-byte digest, personalisation person)
 *
 * with h[-1] = parent. BLAKE2b is implemented here from RFC 7693 (unkeyed, no salt, sequential mode);
 * kvmesh/kv/block_hash.py checks it against hashlib's and falls back to hashlib where this module
 * cannot be built, so every process computes the same digests either way. No torch: routers load it.
 *
 * tokens_bytes(tokens, start, stop) -> bytes
 *   tokens[start:stop] as little-endian uint32 (a list or tuple is read in place, anything else
 *   through a list); OverflowError for a token outside [0, 2**32).
 * chain(parent: 16 bytes, data: bytes-like, step: int, person: bytes (<= 16), start_block: int = 0)
 *   -> list of 16-byte bytes, one per whole step-byte block of data from block start_block on. The
 *   compressions run with the GIL released (a router hashes on many threads).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define DIGEST 16
#define BLOCK_BYTES 128

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) { /* little-endian, whatever the host order */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
#endif
}

#define MIX(a, b, c, d, x, y)                                                                                 \
    do {                                                                                                      \
        v[a] = v[a] + v[b] + (x);                                                                             \
        v[d] = rotr64(v[d] ^ v[a], 32);                                                                       \
        v[c] = v[c] + v[d];                                                                                   \
        v[b] = rotr64(v[b] ^ v[c], 24);                                                                       \
        v[a] = v[a] + v[b] + (y);                                                                             \
        v[d] = rotr64(v[d] ^ v[a], 16);                                                                       \
        v[c] = v[c] + v[d];                                                                                   \
        v[b] = rotr64(v[b] ^ v[c], 63);                                                                       \
    } while (0)

/* F: one 128-byte block into the state h; bytes = message bytes so far, last = final block */
static void compress(uint64_t h[8], const uint8_t block[BLOCK_BYTES], uint64_t bytes, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= bytes; /* the counter's high word stays 0: messages here are far below 2^64 bytes */
    if (last) v[14] = ~v[14];
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++) { /* unrolled: SIGMA's entries become constants, m stays in registers */
        const uint8_t *s = SIGMA[r];
        MIX(0, 4, 8, 12, m[s[0]], m[s[1]]);
        MIX(1, 5, 9, 13, m[s[2]], m[s[3]]);
        MIX(2, 6, 10, 14, m[s[4]], m[s[5]]);
        MIX(3, 7, 11, 15, m[s[6]], m[s[7]]);
        MIX(0, 5, 10, 15, m[s[8]], m[s[9]]);
        MIX(1, 6, 11, 12, m[s[10]], m[s[11]]);
        MIX(2, 7, 8, 13, m[s[12]], m[s[13]]);
        MIX(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b of prefix (prefix_len bytes) || body (body_len bytes) into out (digest bytes), from the
 * parameter-block state `start` (IV already mixed with digest size and personalisation). */
static void hash_two(const uint64_t start[8], const uint8_t *prefix, size_t prefix_len, const uint8_t *body,
                     size_t body_len, int digest, uint8_t *out) {
    uint64_t h[8];
    uint8_t block[BLOCK_BYTES];
    memcpy(h, start, sizeof h);
    size_t total = prefix_len + body_len, done = 0;
    while (done < total) {
        size_t take = total - done < BLOCK_BYTES ? total - done : BLOCK_BYTES;
        size_t from_prefix = done < prefix_len ? (prefix_len - done < take ? prefix_len - done : take) : 0;
        memcpy(block, prefix + done, from_prefix);
        memcpy(block + from_prefix, body + (done + from_prefix - prefix_len), take - from_prefix);
        memset(block + take, 0, BLOCK_BYTES - take);
        done += take;
        compress(h, block, done, done == total);
    }
    for (int i = 0; i < digest; i++) out[i] = (uint8_t)(h[i / 8] >> (8 * (i % 8)));
}


static void chain_digests(const uint64_t start[8], const uint8_t *parent, const uint8_t *data, Py_ssize_t num_blocks,
                          Py_ssize_t step, uint8_t *out) {
    const uint8_t *prev = parent;
    for (Py_ssize_t i = 0; i < num_blocks; i++) {
        hash_two(start, prev, DIGEST, data + i * step, (size_t)step, DIGEST, out + i * DIGEST);
        prev = out + i * DIGEST;
    }
}

static PyObject *chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 4 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError, "chain(parent, data, step, person, start_block=0)");
        return NULL;
    }
    char *parent, *person;
    Py_ssize_t parent_len, person_len;
    if (PyBytes_AsStringAndSize(args[0], &parent, &parent_len) < 0 ||
        PyBytes_AsStringAndSize(args[3], &person, &person_len) < 0)
        return NULL;
    Py_ssize_t step = PyLong_AsSsize_t(args[2]);
    Py_ssize_t start_block = nargs == 5 ? PyLong_AsSsize_t(args[4]) : 0;
    if (PyErr_Occurred())
        return NULL;
    if (parent_len != DIGEST || person_len > 16 || step < 1 || start_block < 0) {
        PyErr_Format(PyExc_ValueError, "chain: parent of %d bytes, person <= 16 bytes, step >= 1, start_block >= 0 "
                     "(got %zd, %zd, %zd, %zd)", DIGEST, parent_len, person_len, step, start_block);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t num_blocks = view.len / step - start_block;
    if (num_blocks < 0)
        num_blocks = 0;
    uint8_t *digests = PyMem_RawMalloc(num_blocks ? (size_t)num_blocks * DIGEST : 1);
    PyObject *out = digests != NULL ? PyList_New(num_blocks) : PyErr_NoMemory();
    if (out == NULL) {
        PyMem_RawFree(digests);
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t start[8];
    uint8_t person16[16] = {0};
    memcpy(person16, person, (size_t)person_len);
    memcpy(start, IV, sizeof start);
    start[0] ^= 0x01010000ULL ^ (uint64_t)DIGEST; /* fanout 1, depth 1, no key */
    start[6] ^= load64(person16);
    start[7] ^= load64(person16 + 8);
    const uint8_t *data = (const uint8_t *)view.buf + start_block * step;
    Py_BEGIN_ALLOW_THREADS
    chain_digests(start, (const uint8_t *)parent, data, num_blocks, step, digests);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    for (Py_ssize_t i = 0; i < num_blocks; i++) {
        PyObject *digest = PyBytes_FromStringAndSize((const char *)digests + i * DIGEST, DIGEST);
        if (digest == NULL) {
            Py_DECREF(out);
            out = NULL;
            break;
        }
        PyList_SET_ITEM(out, i, digest);
    }
    PyMem_RawFree(digests);
    return out;
}

/* An int's value: read in place when it is an exact int of one internal digit (a token id, nearly always),
 * else through PyLong_AsLong (-1 with an error set when it is no int or too large). */
static inline long small_int(PyObject *item) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyLong_CheckExact(item) && PyUnstable_Long_IsCompact((PyLongObject *)item))
        return (long)PyUnstable_Long_CompactValue((PyLongObject *)item);
#else
    if (PyLong_CheckExact(item)) {
        Py_ssize_t size = Py_SIZE(item);
        if (size == 0)
            return 0;
        if (size == 1)
            return (long)((PyLongObject *)item)->ob_digit[0];
    }
#endif
    return PyLong_AsLong(item);
}

static PyObject *tokens_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "tokens_bytes(tokens, start, stop)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), stop = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "tokens must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t size = PySequence_Fast_GET_SIZE(seq);
    if (start < 0 || stop > size || start > stop) {
        PyErr_Format(PyExc_IndexError, "tokens[%zd:%zd] of %zd tokens", start, stop, size);
        Py_DECREF(seq);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * (stop - start));
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = start; i < stop; i++, p += 4) {
        long value = small_int(items[i]);
        if ((value == -1 && PyErr_Occurred()) || value < 0 || (unsigned long)value > 0xFFFFFFFFUL) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_OverflowError, "token %zd is not in [0, 2**32)", i);
            }
            Py_DECREF(out);
            Py_DECREF(seq);
            return NULL;
        }
        uint32_t v = (uint32_t)value;
        p[0] = (uint8_t)v;
        p[1] = (uint8_t)(v >> 8);
        p[2] = (uint8_t)(v >> 16);
        p[3] = (uint8_t)(v >> 24);
    }
    Py_DECREF(seq);
    return out;
}


static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL, "The chained BLAKE2b digests of every whole block."},
    {"tokens_bytes", (PyCFunction)(void (*)(void))tokens_bytes, METH_FASTCALL,
     "tokens[start:stop] as little-endian uint32 bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmesh_blake2b_chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmesh_blake2b_chain(void) { return PyModule_Create(&module); }
