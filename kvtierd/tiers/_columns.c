/* kvtierd.tiers._columns: a batch's reads and writes of the compact index's columns, slot by slot,
 * in C.
 *
 * Why: ChunkIndex keeps each field of every chunk in a column (array.array, bytearray, list:
 * kvtierd/tiers/compact_index.py). A PUT batch that reuses freed slots writes six columns at
 * thousands of scattered slots, a DELETE two, a commit two; in Python that loop was ~0.2 us per
 * 16 KiB chunk of the request loop's time; reading a column at a batch's slots with a map of its
 * __getitem__ cost ~0.1 us per slot. Here each column is read or written in one call.
 *
 * Every slot is checked against the column's length, and every value against the column's item
 * range, before anything is written: a bad call raises and leaves the column as it was.
 * kvtierd.tiers.columns holds the Python reference these are tested against (and runs where this
 * extension was not built).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

/* The n slots of a list or tuple, each in 0..limit-1, into out (PyMem_Malloc'd; the caller frees
 * it). Returns n, or -1 with an exception set. */
static Py_ssize_t slots_of(PyObject *seq, Py_ssize_t limit, Py_ssize_t **out) {
    PyObject *fast = PySequence_Fast(seq, "slots must be a list or tuple of ints");
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
        Py_ssize_t slot = PyLong_AsSsize_t(items[i]);
        if (slot == -1 && PyErr_Occurred()) {
            goto fail;
        }
        if (slot < 0 || slot >= limit) {
            PyErr_Format(PyExc_IndexError, "slots[%zd] is %zd; the column has %zd slots", i,
                         slot, limit);
            goto fail;
        }
        values[i] = slot;
    }
    Py_DECREF(fast);
    *out = values;
    return n;
fail:
    PyMem_Free(values);
    Py_DECREF(fast);
    return -1;
}

/* A column with a writable buffer of unsigned items (bytearray, array('B'/'I'/'L'/'Q')). */
static int column_buffer(PyObject *column, Py_buffer *view) {
    if (PyObject_GetBuffer(column, view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *format = view->format != NULL ? view->format : "B";
    if (strlen(format) != 1 || strchr("BILQ", format[0]) == NULL ||
        (view->itemsize != 1 && view->itemsize != 4 && view->itemsize != 8)) {
        PyErr_Format(PyExc_TypeError, "a column of format %s (item size %zd); allowed: unsigned "
                     "items of 1, 4 or 8 bytes (bytearray, array 'B', 'I', 'L', 'Q')", format,
                     view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* value as an item of `itemsize` bytes, or -1 with an exception set. */
static int item_of(PyObject *value, Py_ssize_t itemsize, Py_ssize_t at, unsigned long long *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "value %zd is %R; allowed: an int in 0..2**%zd-1", at,
                     value, itemsize * 8);
        return -1;
    }
    if (itemsize < 8 && v >> (itemsize * 8)) {
        PyErr_Format(PyExc_ValueError, "value %zd is %llu; allowed: an int in 0..2**%zd-1", at, v,
                     itemsize * 8);
        return -1;
    }
    *out = v;
    return 0;
}

static void store(char *base, Py_ssize_t itemsize, Py_ssize_t slot, unsigned long long v) {
    if (itemsize == 1) {
        ((uint8_t *)base)[slot] = (uint8_t)v;
    } else if (itemsize == 4) {
        ((uint32_t *)base)[slot] = (uint32_t)v;
    } else {
        ((uint64_t *)base)[slot] = (uint64_t)v;
    }
}

/* Write values (a sequence, or one value for every slot when `one`) at slots of column. */
static PyObject *write_at(PyObject *column, PyObject *slots_arg, PyObject *values, int one) {
    PyObject *fast_values = NULL;
    PyObject **items = NULL;
    Py_ssize_t *slots = NULL;
    if (PyList_CheckExact(column)) {
        Py_ssize_t n = slots_of(slots_arg, PyList_GET_SIZE(column), &slots);
        if (n < 0) {
            return NULL;
        }
        if (!one) {
            fast_values = PySequence_Fast(values, "values must be a list or tuple");
            if (fast_values == NULL) {
                goto fail;
            }
            if (PySequence_Fast_GET_SIZE(fast_values) < n) {
                PyErr_Format(PyExc_ValueError, "%zd values for %zd slots",
                             PySequence_Fast_GET_SIZE(fast_values), n);
                goto fail;
            }
            items = PySequence_Fast_ITEMS(fast_values);
        }
        /* The replaced items are released only after every write: releasing one may run
         * arbitrary code (a __del__) that could resize the list under the checked slots. */
        PyObject **olds = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(PyObject *));
        if (olds == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *value = one ? values : items[i];
            Py_INCREF(value);
            olds[i] = PyList_GET_ITEM(column, slots[i]);
            PyList_SET_ITEM(column, slots[i], value);
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_XDECREF(olds[i]);
        }
        PyMem_Free(olds);
        Py_XDECREF(fast_values);
        PyMem_Free(slots);
        Py_RETURN_NONE;
    }
    Py_buffer view;
    if (column_buffer(column, &view) < 0) {
        return NULL;
    }
    unsigned long long *converted = NULL;
    Py_ssize_t n = slots_of(slots_arg, view.len / view.itemsize, &slots);
    if (n < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    unsigned long long same = 0;
    if (one) {
        if (item_of(values, view.itemsize, 0, &same) < 0) {
            goto fail_view;
        }
    } else {
        fast_values = PySequence_Fast(values, "values must be a list or tuple");
        if (fast_values == NULL) {
            goto fail_view;
        }
        if (PySequence_Fast_GET_SIZE(fast_values) < n) {
            PyErr_Format(PyExc_ValueError, "%zd values for %zd slots",
                         PySequence_Fast_GET_SIZE(fast_values), n);
            goto fail_view;
        }
        items = PySequence_Fast_ITEMS(fast_values);
        converted = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(unsigned long long));
        if (converted == NULL) {
            PyErr_NoMemory();
            goto fail_view;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (item_of(items[i], view.itemsize, i, &converted[i]) < 0) {
                goto fail_view;
            }
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        store(view.buf, view.itemsize, slots[i], one ? same : converted[i]);
    }
    PyMem_Free(converted);
    Py_XDECREF(fast_values);
    PyMem_Free(slots);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
fail_view:
    PyMem_Free(converted);
    PyBuffer_Release(&view);
fail:
    Py_XDECREF(fast_values);
    PyMem_Free(slots);
    return NULL;
}

PyDoc_STRVAR(put_at_doc,
"put_at(column, slots, values)\n--\n\n"
"column[slots[i]] = values[i] for every i (values may be longer: its first len(slots), as zip\n"
"pairs them). column: a list, or a bytearray / array of unsigned items ('B', 'I', 'L', 'Q').");

static PyObject *put_at(PyObject *self, PyObject *args) {
    PyObject *column, *slots, *values;
    if (!PyArg_ParseTuple(args, "OOO:put_at", &column, &slots, &values)) {
        return NULL;
    }
    return write_at(column, slots, values, 0);
}

PyDoc_STRVAR(fill_at_doc,
"fill_at(column, slots, value)\n--\n\n"
"column[slot] = value for every slot of slots (column as for put_at).");

static PyObject *fill_at(PyObject *self, PyObject *args) {
    PyObject *column, *slots, *value;
    if (!PyArg_ParseTuple(args, "OOO:fill_at", &column, &slots, &value)) {
        return NULL;
    }
    return write_at(column, slots, value, 1);
}

PyDoc_STRVAR(put_records_at_doc,
"put_records_at(buffer, slots, records, width)\n--\n\n"
"buffer[slots[i] * width : (slots[i] + 1) * width] = records[i] for every i: records of bytes of\n"
"exactly width bytes (the index's checksum column: 16 bytes per slot).");

static PyObject *put_records_at(PyObject *self, PyObject *args) {
    PyObject *buffer, *slots_arg, *records;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OOOn:put_records_at", &buffer, &slots_arg, &records, &width)) {
        return NULL;
    }
    if (width <= 0) {
        return PyErr_Format(PyExc_ValueError, "width is %zd; it must be > 0", width);
    }
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    Py_ssize_t *slots = NULL;
    PyObject *fast = NULL;
    Py_ssize_t n = slots_of(slots_arg, view.len / width, &slots);
    if (n < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    fast = PySequence_Fast(records, "records must be a list or tuple of bytes");
    if (fast == NULL) {
        goto fail;
    }
    if (PySequence_Fast_GET_SIZE(fast) < n) {
        PyErr_Format(PyExc_ValueError, "%zd records for %zd slots", PySequence_Fast_GET_SIZE(fast),
                     n);
        goto fail;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != width) {
            PyErr_Format(PyExc_ValueError, "records[%zd] is %.80R; allowed: bytes of %zd", i,
                         items[i], width);
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy((char *)view.buf + slots[i] * width, PyBytes_AS_STRING(items[i]), (size_t)width);
    }
    Py_DECREF(fast);
    PyMem_Free(slots);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(fast);
    PyMem_Free(slots);
    PyBuffer_Release(&view);
    return NULL;
}

PyDoc_STRVAR(take_at_doc,
"take_at(column, slots, scale=1) -> list | bytes\n--\n\n"
"[column[slot] for slot in slots]: a list, or bytes for a column of one-byte items (a bytearray:\n"
"the index's flags). column as for put_at; every slot is checked first. With scale > 1 (a column\n"
"of 4- or 8-byte items only) each value comes multiplied by it: [column[slot] * scale ...], the\n"
"arena offsets of first pages without an int per slot in Python.");

static PyObject *take_at(PyObject *self, PyObject *args) {
    PyObject *column, *slots_arg;
    unsigned long long scale = 1;
    if (!PyArg_ParseTuple(args, "OO|K:take_at", &column, &slots_arg, &scale)) {
        return NULL;
    }
    if (scale == 0) {
        return PyErr_Format(PyExc_ValueError, "scale is 0; allowed: an int >= 1");
    }
    Py_ssize_t *slots = NULL;
    if (scale != 1 && PyList_CheckExact(column)) {
        return PyErr_Format(PyExc_TypeError, "scale %llu for a column of %.80s; allowed: 1, or a "
                            "column of 4- or 8-byte items", scale, Py_TYPE(column)->tp_name);
    }
    if (PyList_CheckExact(column)) {
        Py_ssize_t n = slots_of(slots_arg, PyList_GET_SIZE(column), &slots);
        if (n < 0) {
            return NULL;
        }
        PyObject *out = PyList_New(n);
        for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
            PyObject *value = PyList_GET_ITEM(column, slots[i]);
            Py_INCREF(value);
            PyList_SET_ITEM(out, i, value);
        }
        PyMem_Free(slots);
        return out;
    }
    Py_buffer view;
    if (column_buffer(column, &view) < 0) {
        return NULL;
    }
    if (scale != 1 && view.itemsize == 1) {  /* a bytearray or array('B'): bytes, unscaled */
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_TypeError, "scale %llu for a column of %.80s; allowed: 1, or a "
                            "column of 4- or 8-byte items", scale, Py_TYPE(column)->tp_name);
    }
    Py_ssize_t n = slots_of(slots_arg, view.len / view.itemsize, &slots);
    if (n < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject *out;
    if (view.itemsize == 1) {
        out = PyBytes_FromStringAndSize(NULL, n);
        if (out != NULL) {
            unsigned char *to = (unsigned char *)PyBytes_AS_STRING(out);
            const unsigned char *from = view.buf;
            for (Py_ssize_t i = 0; i < n; i++) {
                to[i] = from[slots[i]];
            }
        }
    } else {
        out = PyList_New(n);
        for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
            unsigned long long v = view.itemsize == 4 ? ((const uint32_t *)view.buf)[slots[i]]
                                                      : ((const uint64_t *)view.buf)[slots[i]];
            if (scale != 1 && v > ULLONG_MAX / scale) {
                PyErr_Format(PyExc_OverflowError, "column[%zd] * %llu is beyond 64 bits",
                             slots[i], scale);
                Py_CLEAR(out);
                break;
            }
            PyObject *value = PyLong_FromUnsignedLongLong(v * scale);
            if (value == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, i, value);
        }
    }
    PyMem_Free(slots);
    PyBuffer_Release(&view);
    return out;
}

PyDoc_STRVAR(same_at_doc,
"same_at(column, slots) -> value | None\n--\n\n"
"column[slots[0]] when column holds that same value at every slot of slots, else None (None for\n"
"no slots): take_at's answer for a batch of one value, without a list of it. column as for put_at\n"
"(list items compared with ==); every slot is checked first.");

static PyObject *same_at(PyObject *self, PyObject *args) {
    PyObject *column, *slots_arg;
    if (!PyArg_ParseTuple(args, "OO:same_at", &column, &slots_arg)) {
        return NULL;
    }
    Py_ssize_t *slots = NULL;
    if (PyList_CheckExact(column)) {
        Py_ssize_t n = slots_of(slots_arg, PyList_GET_SIZE(column), &slots);
        if (n < 0) {
            return NULL;
        }
        PyObject *first = n ? PyList_GET_ITEM(column, slots[0]) : NULL;
        for (Py_ssize_t i = 1; first != NULL && i < n; i++) {
            PyObject *value = PyList_GET_ITEM(column, slots[i]);
            if (value == first) {
                continue;
            }
            int same = PyObject_RichCompareBool(value, first, Py_EQ);
            if (same < 0) {
                PyMem_Free(slots);
                return NULL;
            }
            if (!same) {
                first = NULL;
            }
        }
        PyMem_Free(slots);
        if (first == NULL) {
            Py_RETURN_NONE;
        }
        Py_INCREF(first);
        return first;
    }
    Py_buffer view;
    if (column_buffer(column, &view) < 0) {
        return NULL;
    }
    Py_ssize_t n = slots_of(slots_arg, view.len / view.itemsize, &slots);
    if (n < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int same = n > 0;
    unsigned long long first = 0;
    for (Py_ssize_t i = 0; same && i < n; i++) {
        unsigned long long v =
            view.itemsize == 1 ? ((const unsigned char *)view.buf)[slots[i]]
            : view.itemsize == 4 ? ((const uint32_t *)view.buf)[slots[i]]
                                 : ((const uint64_t *)view.buf)[slots[i]];
        if (i == 0) {
            first = v;
        } else if (v != first) {
            same = 0;
        }
    }
    PyMem_Free(slots);
    PyBuffer_Release(&view);
    if (!same) {
        Py_RETURN_NONE;
    }
    return PyLong_FromUnsignedLongLong(first);
}

static PyMethodDef methods[] = {
    {"put_at", put_at, METH_VARARGS, put_at_doc},
    {"fill_at", fill_at, METH_VARARGS, fill_at_doc},
    {"put_records_at", put_records_at, METH_VARARGS, put_records_at_doc},
    {"take_at", take_at, METH_VARARGS, take_at_doc},
    {"same_at", same_at, METH_VARARGS, same_at_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "kvtierd.tiers._columns",
    "A batch's writes into the compact index's columns (see kvtierd/tiers/_columns.c).",
    -1,
    methods,
};

PyMODINIT_FUNC PyInit__columns(void) {
    return PyModule_Create(&module);
}
