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
"take_at(column, slots) -> list | bytes\n--\n\n"
"[column[slot] for slot in slots]: a list, or bytes for a column of one-byte items (a bytearray:\n"
"the index's flags). column as for put_at; every slot is checked first.");

static PyObject *take_at(PyObject *self, PyObject *args) {
    PyObject *column, *slots_arg;
    if (!PyArg_ParseTuple(args, "OO:take_at", &column, &slots_arg)) {
        return NULL;
    }
    Py_ssize_t *slots = NULL;
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
            PyObject *value = PyLong_FromUnsignedLongLong(v);
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

/* The eviction policy's per-slot columns (kvtierd/eviction/lru.py): a 32-bit stamp (the slot's
 * position in the access log) and a membership byte. */
typedef struct {
    Py_buffer stamp, member;
    Py_ssize_t slots;  /* the slots both cover */
} lru_columns;

static int lru_columns_of(PyObject *stamp, PyObject *member, lru_columns *out) {
    if (PyObject_GetBuffer(stamp, &out->stamp, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (out->stamp.itemsize != 4 || out->stamp.format == NULL ||
        strchr("IL", out->stamp.format[0]) == NULL) {
        PyErr_Format(PyExc_TypeError, "stamp must be an array of 32-bit unsigned ints (format "
                     "'I'), not of format %s", out->stamp.format ? out->stamp.format : "B");
        PyBuffer_Release(&out->stamp);
        return -1;
    }
    if (PyObject_GetBuffer(member, &out->member, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&out->stamp);
        return -1;
    }
    Py_ssize_t stamps = out->stamp.len / 4;
    out->slots = out->member.len < stamps ? out->member.len : stamps;
    return 0;
}

static void lru_columns_release(lru_columns *columns) {
    PyBuffer_Release(&columns->stamp);
    PyBuffer_Release(&columns->member);
}

/* A position that fits a 32-bit stamp, for every one of n slots from start. */
static int positions_fit(unsigned long long start, Py_ssize_t n) {
    if (start + (unsigned long long)n > 0xFFFFFFFFull) {
        PyErr_Format(PyExc_OverflowError, "positions %llu.. for %zd slots do not fit 32 bits",
                     start, n);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(stamp_members_doc,
"stamp_members(stamp, member, slots, start) -> int\n--\n\n"
"stamp[slots[i]] = start + i for the leading slots that are members (member[slot] != 0); stops\n"
"at the first that is not, or is out of range or not an int >= 0. Returns how many it stamped\n"
"(an LRU's batch of touches: kvtierd/eviction/lru.py).");

static PyObject *stamp_members(PyObject *self, PyObject *args) {
    PyObject *stamp, *member, *slots_arg;
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "OOOK:stamp_members", &stamp, &member, &slots_arg, &start)) {
        return NULL;
    }
    PyObject *fast = PySequence_Fast(slots_arg, "slots must be a list or tuple of ints");
    if (fast == NULL) {
        return NULL;
    }
    lru_columns columns;
    if (lru_columns_of(stamp, member, &columns) < 0) {
        Py_DECREF(fast);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), done = 0;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    if (positions_fit(start, n)) {
        uint32_t *stamps = columns.stamp.buf;
        const unsigned char *members = columns.member.buf;
        for (; done < n; done++) {
            Py_ssize_t slot = PyLong_Check(items[done]) ? PyLong_AsSsize_t(items[done]) : -1;
            if (slot == -1 && PyErr_Occurred()) {
                PyErr_Clear();  /* beyond any column: not a member */
            }
            if (slot < 0 || slot >= columns.slots || !members[slot]) {
                break;
            }
            stamps[slot] = (uint32_t)(start + (unsigned long long)done);
        }
    }
    lru_columns_release(&columns);
    Py_DECREF(fast);
    return PyErr_Occurred() ? NULL : PyLong_FromSsize_t(done);
}

PyDoc_STRVAR(stamp_inserted_doc,
"stamp_inserted(stamp, member, slots, start) -> int\n--\n\n"
"member[slots[i]] = 1 and stamp[slots[i]] = start + i for every i (a slot twice: the later\n"
"position wins); every slot is checked to be in range first. Returns how many were not members\n"
"before (an LRU's batch of inserts).");

static PyObject *stamp_inserted(PyObject *self, PyObject *args) {
    PyObject *stamp, *member, *slots_arg;
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "OOOK:stamp_inserted", &stamp, &member, &slots_arg, &start)) {
        return NULL;
    }
    lru_columns columns;
    if (lru_columns_of(stamp, member, &columns) < 0) {
        return NULL;
    }
    Py_ssize_t *slots = NULL;
    Py_ssize_t n = slots_of(slots_arg, columns.slots, &slots);
    if (n < 0 || !positions_fit(start, n)) {
        PyMem_Free(slots);
        lru_columns_release(&columns);
        return NULL;
    }
    uint32_t *stamps = columns.stamp.buf;
    unsigned char *members = columns.member.buf;
    Py_ssize_t new = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        new += !members[slots[i]];
        members[slots[i]] = 1;
        stamps[slots[i]] = (uint32_t)(start + (unsigned long long)i);
    }
    PyMem_Free(slots);
    lru_columns_release(&columns);
    return PyLong_FromSsize_t(new);
}

PyDoc_STRVAR(unstamp_members_doc,
"unstamp_members(stamp, member, slots, none) -> int\n--\n\n"
"stamp[slot] = none and member[slot] = 0 for every slot that is a member (others, and slots out\n"
"of range, are left alone). Returns how many were members (an LRU's batch of removals).");

static PyObject *unstamp_members(PyObject *self, PyObject *args) {
    PyObject *stamp, *member, *slots_arg;
    unsigned int none;
    if (!PyArg_ParseTuple(args, "OOOI:unstamp_members", &stamp, &member, &slots_arg, &none)) {
        return NULL;
    }
    PyObject *fast = PySequence_Fast(slots_arg, "slots must be a list or tuple of ints");
    if (fast == NULL) {
        return NULL;
    }
    lru_columns columns;
    if (lru_columns_of(stamp, member, &columns) < 0) {
        Py_DECREF(fast);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), removed = 0;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint32_t *stamps = columns.stamp.buf;
    unsigned char *members = columns.member.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t slot = PyLong_Check(items[i]) ? PyLong_AsSsize_t(items[i]) : -1;
        if (slot == -1 && PyErr_Occurred()) {
            PyErr_Clear();
        }
        if (slot >= 0 && slot < columns.slots && members[slot]) {
            stamps[slot] = none;
            members[slot] = 0;
            removed++;
        }
    }
    lru_columns_release(&columns);
    Py_DECREF(fast);
    return PyLong_FromSsize_t(removed);
}

static PyMethodDef methods[] = {
    {"put_at", put_at, METH_VARARGS, put_at_doc},
    {"fill_at", fill_at, METH_VARARGS, fill_at_doc},
    {"put_records_at", put_records_at, METH_VARARGS, put_records_at_doc},
    {"take_at", take_at, METH_VARARGS, take_at_doc},
    {"stamp_members", stamp_members, METH_VARARGS, stamp_members_doc},
    {"stamp_inserted", stamp_inserted, METH_VARARGS, stamp_inserted_doc},
    {"unstamp_members", unstamp_members, METH_VARARGS, unstamp_members_doc},
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
