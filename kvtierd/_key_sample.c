/* kvtierd._key_sample: the keys of a batch the capacity-planning ghosts simulate, in one C loop.
 *
 * Why: every PUT, GET, DELETE and LOOKUP batch hashes each of its keys (64-bit xxh3, seeded by the
 * key space) and keeps those below a sampling threshold (kvtierd/ghost.py); as a map of
 * xxhash.xxh3_64_intdigest plus a comparison per key it was about a tenth of the request loop's
 * time per 16 KiB item, for a sample of one key in eight or fewer. Here the hash of a key that is
 * not sampled never becomes a Python int.
 *
 * The hash is xxhash's own XXH3_64bits_withSeed, reached through the address of the function the
 * `xxhash` package's extension exports (kvtierd.key_sample looks it up and checks it against
 * xxhash.xxh3_64_intdigest before handing it here): no copy of xxHash lives in this project.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef uint64_t (*xxh3_64_seeded_fn)(const void *input, size_t length, uint64_t seed);

PyDoc_STRVAR(below_doc,
"below(keys, seed, threshold, xxh3_64_with_seed_address, positions) -> list | (list, list)\n"
"--\n\n"
"XXH3_64bits_withSeed(key, seed) of every key of bytes in keys, kept where it is below threshold\n"
"(an int in 0..2**64-1; None keeps every key), in order. With positions, also the indices in\n"
"keys of the kept ones.");

static PyObject *below(PyObject *self, PyObject *args) {
    PyObject *keys, *threshold_arg;
    unsigned long long seed, address;
    int positions;
    if (!PyArg_ParseTuple(args, "OKOKp:below", &keys, &seed, &threshold_arg, &address,
                          &positions)) {
        return NULL;
    }
    if (address == 0) {
        return PyErr_Format(PyExc_ValueError, "xxh3_64_with_seed_address is 0");
    }
    int every = threshold_arg == Py_None;  /* None: every key (a sample ratio of 1) */
    unsigned long long threshold = 0;
    if (!every) {
        threshold = PyLong_AsUnsignedLongLong(threshold_arg);  /* an int in 0..2**64-1 */
        if (threshold == (unsigned long long)-1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    PyObject *fast = PySequence_Fast(keys, "keys must be a list or tuple of bytes");
    if (fast == NULL) {
        return NULL;
    }
    xxh3_64_seeded_fn hash = (xxh3_64_seeded_fn)(uintptr_t)address;
    PyObject *out = PyList_New(0), *at = positions ? PyList_New(0) : NULL;
    if (out == NULL || (positions && at == NULL)) {
        goto fail;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        if (!PyBytes_Check(key)) {
            PyErr_Format(PyExc_TypeError, "keys[%zd] is %.80s; keys are bytes", i,
                         Py_TYPE(key)->tp_name);
            goto fail;
        }
        uint64_t h = hash(PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key), seed);
        if (!every && h >= threshold) {
            continue;
        }
        PyObject *value = PyLong_FromUnsignedLongLong(h);
        if (value == NULL || PyList_Append(out, value) < 0) {
            Py_XDECREF(value);
            goto fail;
        }
        Py_DECREF(value);
        if (positions) {
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL || PyList_Append(at, index) < 0) {
                Py_XDECREF(index);
                goto fail;
            }
            Py_DECREF(index);
        }
    }
    Py_DECREF(fast);
    if (positions) {
        return Py_BuildValue("(NN)", out, at);
    }
    return out;
fail:
    Py_DECREF(fast);
    Py_XDECREF(out);
    Py_XDECREF(at);
    return NULL;
}

static PyMethodDef methods[] = {
    {"below", below, METH_VARARGS, below_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "kvtierd._key_sample",
    "The keys of a batch the ghosts simulate, in one C loop (see kvtierd/_key_sample.c).",
    -1,
    methods,
};

PyMODINIT_FUNC PyInit__key_sample(void) {
    return PyModule_Create(&module);
}
