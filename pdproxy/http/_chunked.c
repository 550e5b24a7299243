/* pdproxy.http._chunked: the compiled form of pdproxy.http.server's chunk writer (same results).

   ChunkWriter(writelines)(data) writes one chunk of a chunked HTTP/1.1 body (RFC 9112 §7.1): it calls
   writelines((b"%x\r\n" % len(data), data, b"\r\n")), as functools.partial(_write_chunk, writelines) does
   (pdproxy/http/server.py), so the body is not copied (one writev).  The size lines of bodies under 16 KiB are
   made once and kept (a relayed SSE event is a few hundred bytes).  It takes its one argument by position only
   (the partial also accepts `data=`; no caller passes it so). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdio.h>

#define SIZE_LINES 16384

typedef struct {
    PyObject_HEAD
    PyObject *writelines;   /* callable(iterable of bytes): the transport's writelines */
    vectorcallfunc vectorcall;
} ChunkWriter;

static PyObject *size_lines[SIZE_LINES];  /* b"%x\r\n" % n, made on first use */
static PyObject *crlf;                    /* b"\r\n" */

static PyObject *
size_line(Py_ssize_t n)
{
    if (n < SIZE_LINES) {
        PyObject *line = size_lines[n];
        if (line == NULL) {
            char buf[32];
            int len = snprintf(buf, sizeof buf, "%zx\r\n", n);
            line = size_lines[n] = PyBytes_FromStringAndSize(buf, len);
            if (line == NULL)
                return NULL;
        }
        return Py_NewRef(line);
    }
    char buf[32];
    int len = snprintf(buf, sizeof buf, "%zx\r\n", n);
    return PyBytes_FromStringAndSize(buf, len);
}

static PyObject *
ChunkWriter_vectorcall(ChunkWriter *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "ChunkWriter takes one argument (the chunk's data)");
        return NULL;
    }
    if (self->writelines == NULL) {   /* cleared by the garbage collector's tp_clear */
        PyErr_SetString(PyExc_ValueError, "ChunkWriter: no writelines");
        return NULL;
    }
    PyObject *data = args[0];
    Py_ssize_t n = PyObject_Length(data);
    if (n < 0)
        return NULL;
    PyObject *line = size_line(n);
    if (line == NULL)
        return NULL;
    PyObject *parts = PyTuple_New(3);
    if (parts == NULL) {
        Py_DECREF(line);
        return NULL;
    }
    PyTuple_SET_ITEM(parts, 0, line);
    PyTuple_SET_ITEM(parts, 1, Py_NewRef(data));
    PyTuple_SET_ITEM(parts, 2, Py_NewRef(crlf));
    PyObject *r = PyObject_CallOneArg(self->writelines, parts);
    Py_DECREF(parts);
    return r;
}

static PyObject *
ChunkWriter_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *writelines;
    if (!PyArg_ParseTuple(args, "O:ChunkWriter", &writelines))
        return NULL;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "ChunkWriter takes no keyword arguments");
        return NULL;
    }
    ChunkWriter *self = (ChunkWriter *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->writelines = Py_NewRef(writelines);
    self->vectorcall = (vectorcallfunc)ChunkWriter_vectorcall;
    return (PyObject *)self;
}

static int
ChunkWriter_traverse(ChunkWriter *self, visitproc visit, void *arg)
{
    Py_VISIT(self->writelines);
    return 0;
}

static int
ChunkWriter_clear(ChunkWriter *self)
{
    Py_CLEAR(self->writelines);
    return 0;
}

static void
ChunkWriter_dealloc(ChunkWriter *self)
{
    PyObject_GC_UnTrack(self);
    ChunkWriter_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ChunkWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdproxy.http._chunked.ChunkWriter",
    .tp_doc = "ChunkWriter(writelines)(data): one chunk of a chunked body, written with one writelines call.",
    .tp_basicsize = sizeof(ChunkWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = ChunkWriter_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(ChunkWriter, vectorcall),
    .tp_traverse = (traverseproc)ChunkWriter_traverse,
    .tp_clear = (inquiry)ChunkWriter_clear,
    .tp_dealloc = (destructor)ChunkWriter_dealloc,
};

static struct PyModuleDef chunked_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pdproxy.http._chunked",
    .m_doc = "Compiled ChunkWriter (pdproxy/http/server.py holds the same in Python: _write_chunk).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__chunked(void)
{
    crlf = PyBytes_FromStringAndSize("\r\n", 2);
    if (crlf == NULL)
        return NULL;
    if (PyType_Ready(&ChunkWriterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&chunked_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ChunkWriterType);
    if (PyModule_AddObject(m, "ChunkWriter", (PyObject *)&ChunkWriterType) < 0) {
        Py_DECREF(&ChunkWriterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
