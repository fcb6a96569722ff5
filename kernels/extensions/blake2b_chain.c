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
 * chain(parent: 16 bytes, data: bytes-like, step: int, person: bytes (<= 16), start_block: int = 0, scalar=False)
 *   -> list of 16-byte bytes, one per whole step-byte block of data from block start_block on. The
 *   compressions run with the GIL released (a router hashes on many threads). Blocks of 16 tokens
 *   (step 64) go through the AVX-512 chain where the build targets it (blake2b_avx512.h; VECTOR says
 *   whether it does); scalar=True takes the portable compression instead (for tests and benchmarks).
 * chain_tokens(parent, tokens, block_size, person, start_block=0) -> (bytes, list of digests)
 *   tokens_bytes of the whole blocks from block start_block on, and chain over them, in one pass: with the
 *   AVX-512 chain, a block's tokens are read while the previous block is compressed, the GIL held
 *   throughout (it reads the list); otherwise the conversion, then the chain without the GIL.
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

#include "blake2b_avx512.h"

static void chain_digests(const uint64_t start[8], const uint8_t *parent, const uint8_t *data, Py_ssize_t num_blocks,
                          Py_ssize_t step, int scalar, uint8_t *out) {
#if BLAKE2B_CHAIN_VECTOR
    if (step == 64 && !scalar) {
        chain_digests_64_avx512(start, parent, data, num_blocks, out);
        return;
    }
#else
    (void)scalar;
#endif
    const uint8_t *prev = parent;
    for (Py_ssize_t i = 0; i < num_blocks; i++) {
        hash_two(start, prev, DIGEST, data + i * step, (size_t)step, DIGEST, out + i * DIGEST);
        prev = out + i * DIGEST;
    }
}

/* The parameter-block state of a chain: digest size, fanout 1, depth 1, no key, personalisation person
 * (checked: a bytes object of <= 16 bytes); -1 with ValueError/TypeError set otherwise. */
static int chain_start(PyObject *person_obj, uint64_t start[8]) {
    char *person;
    Py_ssize_t person_len;
    if (PyBytes_AsStringAndSize(person_obj, &person, &person_len) < 0)
        return -1;
    if (person_len > 16) {
        PyErr_Format(PyExc_ValueError, "person of %zd bytes: at most 16", person_len);
        return -1;
    }
    uint8_t person16[16] = {0};
    memcpy(person16, person, (size_t)person_len);
    memcpy(start, IV, 8 * sizeof start[0]);
    start[0] ^= 0x01010000ULL ^ (uint64_t)DIGEST;
    start[6] ^= load64(person16);
    start[7] ^= load64(person16 + 8);
    return 0;
}

static const uint8_t *parent_digest(PyObject *parent_obj) {
    char *parent;
    Py_ssize_t parent_len;
    if (PyBytes_AsStringAndSize(parent_obj, &parent, &parent_len) < 0)
        return NULL;
    if (parent_len != DIGEST) {
        PyErr_Format(PyExc_ValueError, "parent of %zd bytes: expected %d", parent_len, DIGEST);
        return NULL;
    }
    return (const uint8_t *)parent;
}

/* A list of num_blocks 16-byte bytes objects cut from digests; NULL with an error set. */
static PyObject *digest_list(const uint8_t *digests, Py_ssize_t num_blocks) {
    PyObject *out = PyList_New(num_blocks);
    for (Py_ssize_t i = 0; out != NULL && i < num_blocks; i++) {
        PyObject *digest = PyBytes_FromStringAndSize((const char *)digests + i * DIGEST, DIGEST);
        if (digest == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, digest);
    }
    return out;
}

static PyObject *chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 4 || nargs > 6) {
        PyErr_SetString(PyExc_TypeError, "chain(parent, data, step, person, start_block=0, scalar=False)");
        return NULL;
    }
    uint64_t start[8];
    const uint8_t *parent = parent_digest(args[0]);
    if (parent == NULL || chain_start(args[3], start) < 0)
        return NULL;
    Py_ssize_t step = PyLong_AsSsize_t(args[2]);
    Py_ssize_t start_block = nargs >= 5 ? PyLong_AsSsize_t(args[4]) : 0;
    int scalar = nargs == 6 ? PyObject_IsTrue(args[5]) : 0;
    if (PyErr_Occurred())
        return NULL;
    if (step < 1 || start_block < 0) {
        PyErr_Format(PyExc_ValueError, "chain: step >= 1, start_block >= 0 (got %zd, %zd)", step, start_block);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t num_blocks = view.len / step - start_block;
    if (num_blocks < 0)
        num_blocks = 0;
    uint8_t *digests = PyMem_RawMalloc(num_blocks ? (size_t)num_blocks * DIGEST : 1);
    if (digests == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    const uint8_t *data = (const uint8_t *)view.buf + start_block * step;
    Py_BEGIN_ALLOW_THREADS
    chain_digests(start, parent, data, num_blocks, step, scalar, digests);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyObject *out = digest_list(digests, num_blocks);
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

/* items[start:stop] as little-endian uint32 at p; -1 with OverflowError (or the int conversion's error) set when
 * an item is no token. The objects are prefetched a little ahead: a fresh prompt's ints are rarely in cache. */
static inline int convert_tokens(PyObject *const *items, Py_ssize_t start, Py_ssize_t stop, Py_ssize_t size,
                                 uint8_t *p) {
    for (Py_ssize_t i = start; i < stop; i++, p += 4) {
        if (i + 16 < size)
            __builtin_prefetch(items[i + 16]);
        long value = small_int(items[i]);
        if ((value == -1 && PyErr_Occurred()) || value < 0 || (unsigned long)value > 0xFFFFFFFFUL) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_OverflowError, "token %zd is not in [0, 2**32)", i);
            }
            return -1;
        }
        uint32_t v = (uint32_t)value;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        memcpy(p, &v, 4);
#else
        p[0] = (uint8_t)v;
        p[1] = (uint8_t)(v >> 8);
        p[2] = (uint8_t)(v >> 16);
        p[3] = (uint8_t)(v >> 24);
#endif
    }
    return 0;
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
    PyObject *out = NULL;
    if (start < 0 || stop > size || start > stop)
        PyErr_Format(PyExc_IndexError, "tokens[%zd:%zd] of %zd tokens", start, stop, size);
    else if ((out = PyBytes_FromStringAndSize(NULL, 4 * (stop - start))) != NULL &&
             convert_tokens(PySequence_Fast_ITEMS(seq), start, stop, size, (uint8_t *)PyBytes_AS_STRING(out)) < 0)
        Py_CLEAR(out);
    Py_DECREF(seq);
    return out;
}

/* The digests of 16-token blocks into the list hashes (num_blocks long, unset), each block's tokens read and the
 * previous digest's bytes object made while the block before is compressed (that work hides in the
 * compression's latency). Holds the GIL: it reads the token list and makes objects. */
#if BLAKE2B_CHAIN_VECTOR
static int chain_tokens_64(const uint64_t start[8], const uint8_t *parent, PyObject *const *items,
                           Py_ssize_t first_token, Py_ssize_t size, Py_ssize_t num_blocks, uint8_t *data,
                           uint8_t *digests, PyObject *hashes) {
    const B2ChainKey key = b2_chain_key(start);
    __m256i prev = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)parent));
    if (convert_tokens(items, first_token, first_token + 16, size, data) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < num_blocks; i++) {
        Py_ssize_t next = first_token + 16 * (i + 1);
        if (i + 1 < num_blocks && convert_tokens(items, next, next + 16, size, data + 64 * (i + 1)) < 0)
            return -1;
        if (i > 0) {
            PyObject *digest = PyBytes_FromStringAndSize((const char *)digests + DIGEST * (i - 1), DIGEST);
            if (digest == NULL)
                return -1;
            PyList_SET_ITEM(hashes, i - 1, digest);
        }
        prev = b2_next_digest(&key, prev, data + 64 * i);
        _mm_storeu_si128((__m128i *)(digests + DIGEST * i), _mm256_castsi256_si128(prev));
    }
    PyObject *digest = PyBytes_FromStringAndSize((const char *)digests + DIGEST * (num_blocks - 1), DIGEST);
    if (digest == NULL)
        return -1;
    PyList_SET_ITEM(hashes, num_blocks - 1, digest);
    return 0;
}
#endif

static PyObject *chain_tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 4 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError, "chain_tokens(parent, tokens, block_size, person, start_block=0)");
        return NULL;
    }
    uint64_t start[8];
    const uint8_t *parent = parent_digest(args[0]);
    if (parent == NULL || chain_start(args[3], start) < 0)
        return NULL;
    Py_ssize_t block_size = PyLong_AsSsize_t(args[2]);
    Py_ssize_t start_block = nargs == 5 ? PyLong_AsSsize_t(args[4]) : 0;
    if (PyErr_Occurred())
        return NULL;
    if (block_size < 1 || start_block < 0) {
        PyErr_Format(PyExc_ValueError, "chain_tokens: block_size >= 1, start_block >= 0 (got %zd, %zd)", block_size,
                     start_block);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "tokens must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t size = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t num_blocks = size / block_size - start_block, step = 4 * block_size;
    if (num_blocks < 0)
        num_blocks = 0;
    PyObject *data = PyBytes_FromStringAndSize(NULL, num_blocks * step), *hashes = NULL, *out = NULL;
    uint8_t *digests = PyMem_RawMalloc(num_blocks ? (size_t)num_blocks * DIGEST : 1);
    if (data == NULL || digests == NULL) {
        if (digests == NULL)
            PyErr_NoMemory();
        goto done;
    }
    uint8_t *bytes = (uint8_t *)PyBytes_AS_STRING(data);
    Py_ssize_t first_token = start_block * block_size;
    /* the token list's items are read after the last allocation that could run a collection */
#if BLAKE2B_CHAIN_VECTOR
    if (step == 64 && num_blocks > 0) {
        if ((hashes = PyList_New(num_blocks)) == NULL ||
            chain_tokens_64(start, parent, PySequence_Fast_ITEMS(seq), first_token, size, num_blocks, bytes, digests,
                            hashes) < 0)
            goto done; /* a list's unset items are NULL, which its deallocation skips */
    } else
#endif
    {
        if (convert_tokens(PySequence_Fast_ITEMS(seq), first_token, first_token + num_blocks * block_size, size,
                           bytes) < 0)
            goto done;
        Py_BEGIN_ALLOW_THREADS
        chain_digests(start, parent, bytes, num_blocks, step, 0, digests);
        Py_END_ALLOW_THREADS
        if ((hashes = digest_list(digests, num_blocks)) == NULL)
            goto done;
    }
    out = PyTuple_Pack(2, data, hashes);
done:
    Py_XDECREF(hashes);
    Py_XDECREF(data);
    PyMem_RawFree(digests);
    Py_DECREF(seq);
    return out;
}


static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL, "The chained BLAKE2b digests of every whole block."},
    {"tokens_bytes", (PyCFunction)(void (*)(void))tokens_bytes, METH_FASTCALL,
     "tokens[start:stop] as little-endian uint32 bytes."},
    {"chain_tokens", (PyCFunction)(void (*)(void))chain_tokens, METH_FASTCALL,
     "(token bytes, digests) of every whole block of tokens from block start_block on."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmesh_blake2b_chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmesh_blake2b_chain(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "VECTOR", BLAKE2B_CHAIN_VECTOR) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
