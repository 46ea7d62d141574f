/* kvtierd.copy._ranges: a copy job's memmoves (and their xxh3-128s) in one call without the GIL.
 *
 * Why: a PUT or GET job of small chunks made one ctypes.memmove (and, for a PUT, one xxhash call)
 * per chunk, each releasing and retaking the GIL: two hand-offs per 16 KiB chunk between a copy
 * thread and the request loop, which bounded small chunks at a quarter of memcpy's speed. Here the
 * offsets are read with the GIL held, then the whole job runs with it released, once. A PUT's
 * chunks are copied by pieces with streaming stores (copy_streaming), each piece hashed from the
 * source's lines the copy has just read: the arena's lines are never read in to be overwritten.
 *
 * The checksum is xxhash's own XXH3_128bits, reached through the address of the function that the
 * `xxhash` package's extension exports (kvtierd.copy.memcpy looks it up and checks it against
 * xxhash.xxh3_128_digest before handing it here): no copy of xxHash lives in this project.
 *
 * Addresses are trusted, as ctypes.memmove's are: the callers (kvtierd.staging) have checked every
 * range against its mapping before a job is built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* XXH128_hash_t's layout (xxhash.h): the low half first. Returned in registers on x86-64 and
 * aarch64, as any 16-byte struct of two integers. */
typedef struct {
    uint64_t low64;
    uint64_t high64;
} xxh128_hash;

typedef xxh128_hash (*xxh3_128_fn)(const void *input, size_t length);

/* xxHash's streaming API (XXH3_state_t is opaque here: only xxHash's own functions touch it). A
 * range longer than a piece is copied and hashed piece by piece, each piece hashed right after its
 * copy while it is still in L2, and the whole range is still one GIL release. */
typedef void *(*xxh3_create_fn)(void);
typedef int (*xxh3_free_fn)(void *state);
typedef int (*xxh3_reset_fn)(void *state);
typedef int (*xxh3_update_fn)(void *state, const void *input, size_t length);
typedef xxh128_hash (*xxh3_digest_fn)(const void *state);

typedef struct {
    xxh3_create_fn create;
    xxh3_free_fn free;
    xxh3_reset_fn reset;
    xxh3_update_fn update;
    xxh3_digest_fn digest;
} xxh3_stream;

/* The five addresses of a stream tuple (create, free, reset, update, digest); 0 on success, -1
 * with an exception set. */
static int stream_of(PyObject *addresses, xxh3_stream *out) {
    unsigned long long a[5];
    if (!PyTuple_Check(addresses) ||
        !PyArg_ParseTuple(addresses, "KKKKK;stream is (create, free, reset, update, digest)",
                          &a[0], &a[1], &a[2], &a[3], &a[4])) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "stream is a tuple of 5 addresses "
                                             "(create, free, reset, update, digest)");
        }
        return -1;
    }
    for (int i = 0; i < 5; i++) {
        if (a[i] == 0) {
            PyErr_Format(PyExc_ValueError, "stream address %d is 0", i);
            return -1;
        }
    }
    out->create = (xxh3_create_fn)(uintptr_t)a[0];
    out->free = (xxh3_free_fn)(uintptr_t)a[1];
    out->reset = (xxh3_reset_fn)(uintptr_t)a[2];
    out->update = (xxh3_update_fn)(uintptr_t)a[3];
    out->digest = (xxh3_digest_fn)(uintptr_t)a[4];
    return 0;
}

#define DIGEST_BYTES 16

/* XXH128_canonicalFromHash: big-endian, high half first (what xxh3_128_digest returns). */
static void canonical(const xxh128_hash *hash, unsigned char *out) {
    for (int i = 0; i < 8; i++) {
        out[i] = (unsigned char)(hash->high64 >> (56 - 8 * i));
        out[8 + i] = (unsigned char)(hash->low64 >> (56 - 8 * i));
    }
}

/* The n non-negative integers of a list or tuple, into out (PyMem_Malloc'd; the caller frees it).
 * Returns the count, or -1 with an exception set. */
static Py_ssize_t offsets_of(PyObject *seq, const char *what, Py_ssize_t **out) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_ssize_t *values = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(Py_ssize_t));
    if (values == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t value = PyLong_AsSsize_t(items[i]);
        if (value < 0) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "%s[%zd] is %zd; offsets are >= 0", what, i, value);
            }
            PyMem_Free(values);
            Py_DECREF(fast);
            return -1;
        }
        values[i] = value;
    }
    Py_DECREF(fast);
    *out = values;
    return n;
}

/* The three offset lists of a job, of one length. Returns the length or -1 (exception set). */
static Py_ssize_t job_offsets(PyObject *dsts, PyObject *srcs, PyObject *sizes, Py_ssize_t **dst,
                              Py_ssize_t **src, Py_ssize_t **size) {
    Py_ssize_t n = offsets_of(dsts, "dsts", dst);
    if (n < 0) {
        return -1;
    }
    Py_ssize_t m = offsets_of(srcs, "srcs", src);
    if (m < 0) {
        PyMem_Free(*dst);
        return -1;
    }
    Py_ssize_t k = n;
    if (sizes != NULL && (k = offsets_of(sizes, "sizes", size)) < 0) {
        PyMem_Free(*dst);
        PyMem_Free(*src);
        return -1;
    }
    if (m != n || k != n) {
        PyErr_Format(PyExc_ValueError, "dsts, srcs and sizes differ in length: %zd, %zd, %zd", n,
                     m, k);
        PyMem_Free(*dst);
        PyMem_Free(*src);
        if (sizes != NULL) {
            PyMem_Free(*size);
        }
        return -1;
    }
    return n;
}

/* Copy n bytes with non-temporal (streaming) stores where the CPU has them: the destination's
 * lines are written without first being read into the cache (a plain store reads each line it
 * fills), so a PUT moves its bytes across the memory bus twice instead of three times, and leaves
 * the cache to the bytes read next. Measured here (Zen 3, 2 cores): 4 KiB pieces streamed from
 * L1-hot bytes, then hashed, ran at 1.1-1.3x of glibc's memcpy of the same 64 MiB; memmove then a
 * hash of the destination at 0.9x. The head up to the first 16-byte boundary of the destination and
 * the tail below 64 bytes go through memcpy. The caller fences (store_fence) before the job ends.
 * The two ranges must not overlap. */
static void copy_streaming(char *to, const char *from, size_t n) {
#if defined(__SSE2__)
    size_t head = (size_t)(-(uintptr_t)to & 15);
    if (head > n) {
        head = n;
    }
    memcpy(to, from, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(from + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(from + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(from + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(from + i + 48));
        _mm_stream_si128((__m128i *)(to + i), a);
        _mm_stream_si128((__m128i *)(to + i + 16), b);
        _mm_stream_si128((__m128i *)(to + i + 32), c);
        _mm_stream_si128((__m128i *)(to + i + 48), d);
    }
    memcpy(to + i, from + i, n - i);
#else
    memcpy(to, from, n);
#endif
}

/* Streaming stores are weakly ordered: fence them before the job reports done, so that whoever
 * reads the destination after the job's completion sees every byte. */
static void store_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* One range of a GET job (arena -> staging), streamed: the client's scatter reads staging next,
 * from another core, so keeping the lines in this core's cache buys nothing, and not reading them
 * in first saves a third of the bus traffic. Measured here, 4 runs alternating with memmove:
 * cpu_roundtrip GET / memcpy 1.03-2.14x against 0.87-1.31x, client_path load / ceiling
 * 1.00-1.20x against 0.88-1.07x. Overlapping ranges (never a GET's) are one memmove. The caller
 * fences. */
static void copy_range(char *to, const char *from, size_t n) {
    if (to < from + n && from < to + n) {
        memmove(to, from, n);
    } else {
        copy_streaming(to, from, n);
    }
}

/* copy_streaming of one range, fenced: for compiled callers outside this module, reached by the
 * address streaming_copy_address() returns (the client's gather into staging). */
static void copy_streaming_fenced(char *to, const char *from, size_t n) {
    copy_streaming(to, from, n);
    store_fence();
}

/* Copy length bytes from `from` to `to` piece by piece, each piece fed to the hash state right
 * after its copy, from the source's lines that the copy just brought into L1. Runs without the GIL.
 * The digest is of the bytes as the copy read them; a client that rewrites its staging during its
 * own PUT (which the protocol forbids) can make a chunk whose digest does not match its arena
 * bytes, and the chunk's next check (a promotion from NVMe, a remote fetch, the first read after a
 * warm restart) counts and drops it as a miss. Overlapping ranges (never a PUT's: staging and
 * arena are two mappings) are one memmove, then hashed at the destination. */
static void copy_update(const xxh3_stream *stream, void *state, char *to, const char *from,
                        size_t length, size_t piece) {
    if (to < from + length && from < to + length) {
        memmove(to, from, length);
        stream->update(state, to, length);
        return;
    }
    for (size_t done = 0; done < length; done += piece) {
        size_t part = length - done < piece ? length - done : piece;
        copy_streaming(to + done, from + done, part);
        stream->update(state, from + done, part);
    }
}

/* The canonical digests (16 bytes each) of n chunks as a list of bytes; NULL with an exception. */
static PyObject *digest_list(const unsigned char *digests, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *digest = PyBytes_FromStringAndSize((const char *)digests + i * DIGEST_BYTES,
                                                     DIGEST_BYTES);
        if (digest == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, digest);
    }
    return out;
}

PyDoc_STRVAR(copy_many_doc,
"copy_many(dst_address, dsts, src_address, srcs, sizes)\n--\n\n"
"Copy sizes[i] bytes from src_address + srcs[i] to dst_address + dsts[i], for every i, in one\n"
"call that holds the GIL only to read the lists: with streaming stores, or as memmove where a\n"
"range's source and destination overlap.");

static PyObject *copy_many(PyObject *self, PyObject *args) {
    unsigned long long dst_address, src_address;
    PyObject *dsts, *srcs, *sizes;
    if (!PyArg_ParseTuple(args, "KOKOO:copy_many", &dst_address, &dsts, &src_address, &srcs,
                          &sizes)) {
        return NULL;
    }
    Py_ssize_t *dst, *src, *size;
    Py_ssize_t n = job_offsets(dsts, srcs, sizes, &dst, &src, &size);
    if (n < 0) {
        return NULL;
    }
    char *to = (char *)(uintptr_t)dst_address;
    const char *from = (const char *)(uintptr_t)src_address;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        copy_range(to + dst[i], from + src[i], (size_t)size[i]);
    }
    store_fence();
    Py_END_ALLOW_THREADS
    PyMem_Free(dst);
    PyMem_Free(src);
    PyMem_Free(size);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(copy_hash_many_doc,
"copy_hash_many(dst_address, dsts, src_address, srcs, sizes, xxh3_128_address) -> list[bytes]\n"
"--\n\n"
"memmove sizes[i] bytes (or sizes bytes, if an int) from src_address + srcs[i] to dst_address +\n"
"dsts[i], for every i, and hash each destination range right after its copy (still in cache) with\n"
"the XXH3_128bits at xxh3_128_address; the canonical 16-byte digests, in order. The GIL is\n"
"released for the copies.");

static PyObject *copy_hash_many(PyObject *self, PyObject *args) {
    unsigned long long dst_address, src_address, hash_address;
    PyObject *dsts, *srcs, *sizes;
    if (!PyArg_ParseTuple(args, "KOKOOK:copy_hash_many", &dst_address, &dsts, &src_address,
                          &srcs, &sizes, &hash_address)) {
        return NULL;
    }
    Py_ssize_t nbytes = -1; /* one size for every range, or -1: a list of them */
    if (PyLong_Check(sizes)) {
        nbytes = PyLong_AsSsize_t(sizes);
        if (nbytes < 0) {
            return PyErr_Occurred() ? NULL
                                    : PyErr_Format(PyExc_ValueError,
                                                   "sizes is %zd; it must be >= 0", nbytes);
        }
    }
    if (hash_address == 0) {
        return PyErr_Format(PyExc_ValueError, "xxh3_128_address is 0");
    }
    Py_ssize_t *dst, *src, *size = NULL;
    Py_ssize_t n = job_offsets(dsts, srcs, nbytes < 0 ? sizes : NULL, &dst, &src, &size);
    if (n < 0) {
        return NULL;
    }
    unsigned char *digests = PyMem_Malloc((size_t)(n > 0 ? n : 1) * DIGEST_BYTES);
    if (digests == NULL) {
        PyMem_Free(dst);
        PyMem_Free(src);
        PyMem_Free(size);
        return PyErr_NoMemory();
    }
    xxh3_128_fn hash = (xxh3_128_fn)(uintptr_t)hash_address;
    char *to = (char *)(uintptr_t)dst_address;
    const char *from = (const char *)(uintptr_t)src_address;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t length = (size_t)(size != NULL ? size[i] : nbytes);
        memmove(to + dst[i], from + src[i], length);
        xxh128_hash h = hash(to + dst[i], length);
        canonical(&h, digests + i * DIGEST_BYTES);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(dst);
    PyMem_Free(src);
    PyMem_Free(size);
    PyObject *out = digest_list(digests, n);
    PyMem_Free(digests);
    return out;
}

PyDoc_STRVAR(copy_hash_chunks_doc,
"copy_hash_chunks(dst_address, dsts, src_address, srcs, sizes, counts, xxh3_128_address,\n"
"                 piece_bytes, stream) -> list[bytes]\n"
"--\n\n"
"copy_hash_many of chunks made of several ranges: chunk j is the next counts[j] ranges (copy\n"
"sizes[i] bytes from src_address + srcs[i] to dst_address + dsts[i]), hashed as one payload in\n"
"range order, piece by piece with stream, each piece copied with streaming stores and hashed\n"
"from the source's just-read lines; a chunk of one range of at most piece_bytes is memmoved and\n"
"hashed in one call at xxh3_128_address. One canonical digest per chunk. The GIL is released\n"
"once.");

static PyObject *copy_hash_chunks(PyObject *self, PyObject *args) {
    unsigned long long dst_address, src_address, hash_address;
    PyObject *dsts, *srcs, *sizes, *counts_seq, *stream_addresses;
    Py_ssize_t piece;
    if (!PyArg_ParseTuple(args, "KOKOOOKnO:copy_hash_chunks", &dst_address, &dsts, &src_address,
                          &srcs, &sizes, &counts_seq, &hash_address, &piece, &stream_addresses)) {
        return NULL;
    }
    xxh3_stream stream;
    if (hash_address == 0) {
        return PyErr_Format(PyExc_ValueError, "xxh3_128_address is 0");
    }
    if (piece <= 0) {
        return PyErr_Format(PyExc_ValueError, "piece_bytes is %zd; it must be > 0", piece);
    }
    if (stream_of(stream_addresses, &stream) < 0) {
        return NULL;
    }
    Py_ssize_t *counts;
    Py_ssize_t chunks = offsets_of(counts_seq, "counts", &counts);
    if (chunks < 0) {
        return NULL;
    }
    Py_ssize_t *dst, *src, *size;
    Py_ssize_t n = job_offsets(dsts, srcs, sizes, &dst, &src, &size);
    if (n < 0) {
        PyMem_Free(counts);
        return NULL;
    }
    Py_ssize_t ranges = 0; /* never past n + 1: a larger count cannot add up to n */
    for (Py_ssize_t j = 0; j < chunks && ranges <= n; j++) {
        ranges = counts[j] > n - ranges ? n + 1 : ranges + counts[j];
    }
    unsigned char *digests = NULL;
    void *state = NULL;
    if (ranges != n) {
        PyErr_Format(PyExc_ValueError, "counts add up to %s%zd ranges; the job has %zd",
                     ranges > n ? "more than " : "", ranges > n ? n : ranges, n);
    } else if ((digests = PyMem_Malloc((size_t)(chunks > 0 ? chunks : 1) * DIGEST_BYTES)) == NULL) {
        PyErr_NoMemory();
    } else if ((state = stream.create()) == NULL) {
        PyErr_NoMemory();
    }
    if (state == NULL) {
        PyMem_Free(digests);
        PyMem_Free(counts);
        PyMem_Free(dst);
        PyMem_Free(src);
        PyMem_Free(size);
        return NULL;
    }
    xxh3_128_fn hash = (xxh3_128_fn)(uintptr_t)hash_address;
    char *to = (char *)(uintptr_t)dst_address;
    const char *from = (const char *)(uintptr_t)src_address;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t i = 0;
    for (Py_ssize_t j = 0; j < chunks; j++) {
        xxh128_hash h;
        if (counts[j] == 1 && size[i] <= piece) {
            memmove(to + dst[i], from + src[i], (size_t)size[i]);
            h = hash(to + dst[i], (size_t)size[i]);
            i++;
        } else {
            stream.reset(state);
            for (Py_ssize_t end = i + counts[j]; i < end; i++) {
                copy_update(&stream, state, to + dst[i], from + src[i], (size_t)size[i],
                            (size_t)piece);
            }
            h = stream.digest(state);
        }
        canonical(&h, digests + j * DIGEST_BYTES);
    }
    store_fence();
    Py_END_ALLOW_THREADS
    stream.free(state);
    PyMem_Free(counts);
    PyMem_Free(dst);
    PyMem_Free(src);
    PyMem_Free(size);
    PyObject *out = digest_list(digests, chunks);
    PyMem_Free(digests);
    return out;
}

PyDoc_STRVAR(streaming_copy_address_doc,
"streaming_copy_address() -> int\n--\n\n"
"The address of void copy(void *dst, const void *src, size_t n): n bytes copied with streaming\n"
"stores where the CPU has them (memcpy elsewhere), fenced before it returns. The ranges must not\n"
"overlap.");

static PyObject *streaming_copy_address(PyObject *self, PyObject *unused) {
    return PyLong_FromVoidPtr((void *)&copy_streaming_fenced);
}

static PyMethodDef methods[] = {
    {"streaming_copy_address", streaming_copy_address, METH_NOARGS, streaming_copy_address_doc},
    {"copy_many", copy_many, METH_VARARGS, copy_many_doc},
    {"copy_hash_many", copy_hash_many, METH_VARARGS, copy_hash_many_doc},
    {"copy_hash_chunks", copy_hash_chunks, METH_VARARGS, copy_hash_chunks_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "kvtierd.copy._ranges",
    "A copy job's memmoves and xxh3-128s in one GIL-free call (see kvtierd/copy/_ranges.c).",
    -1,
    methods,
};

PyMODINIT_FUNC PyInit__ranges(void) {
    return PyModule_Create(&module);
}
