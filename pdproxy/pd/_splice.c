/* pdproxy.pd._splice: the compiled form of pdproxy.pd.splice.PySpliceBase (same names, same results).

   SpliceBase.data(chunk) is the per-read step of the relay's splice (pdproxy/pd/relay.py, "The splice"): for the
   common read — whole events framed as vLLM frames them (bytes ending in a blank line, no '\r' anywhere), no
   tail held, the transform's trigger absent, not a keep-alive comment, not the stream's end — it counts the
   inter-write gap into the stream's ITL buckets (pdproxy.timeline.GapCounts: counts[bisect_left(bounds, gap)] += 1,
   total += gap), keeps the block as `prev` and calls `write(chunk)`; once the client's response has ended
   (`out.ended`) it drops the read, as the Python code does.  Every other read goes to `self._slow(chunk)` (the
   subclass's full Python step, pdproxy/pd/relay.py `_Splice._slow`), which re-tests it from the start: the fast
   path changes nothing before it hands over.

   The clock is `self.clock` (the subclass sets time.monotonic; a test may give a fake one); when it is
   time.monotonic, CLOCK_MONOTONIC is read directly, the clock Python's time.monotonic() reads on Linux
   (Python/pytime.c). */

#define _GNU_SOURCE  /* memmem */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    PyObject *write;      /* callable(bytes): the client's body writer */
    PyObject *feed;       /* callable(block, prev) -> bytes: the transform */
    PyObject *trigger;    /* bytes: a block holding it goes to _slow (b"": every block) */
    PyObject *prev;       /* bytes: the block written before */
    PyObject *tail;       /* bytes | bytearray: an incomplete event held for its rest */
    PyObject *out;        /* the Responder: its `ended` is read per block */
    PyObject *gaps;       /* GapCounts: its `total` is added to */
    PyObject *bounds;     /* sequence of float: the ITL buckets' upper bounds, +Inf last */
    PyObject *counts;     /* list of int: the ITL buckets' counts (any sequence: counts[i] += 1) */
    PyObject *clock;      /* callable() -> float: monotonic seconds (time.monotonic: read here directly) */
    Py_ssize_t done_len;  /* the shortest end event's length */
    Py_ssize_t writes;    /* blocks written */
    double last;          /* monotonic seconds of the last write */
    int done_mark;        /* the byte before the end event's blank line */
} SpliceBase;

static PyObject *slow_name;   /* interned "_slow" */
static PyObject *emit_name;   /* interned "_emit" */
static PyObject *ended_name;  /* interned "ended" */
static PyObject *total_name;  /* interned "total" */
static PyObject *monotonic;   /* time.monotonic, whose clock `now` reads without calling it */

/* Monotonic seconds from self.clock: CLOCK_MONOTONIC when it is time.monotonic (Python/pytime.c reads the same
   clock), else its call (a test's fake clock); -1 with an exception set on failure. */
static double
now_s(SpliceBase *self)
{
    if (self->clock == NULL || self->clock == monotonic) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    }
    PyObject *clock = Py_NewRef(self->clock);
    PyObject *t = PyObject_CallNoArgs(clock);
    Py_DECREF(clock);
    if (t == NULL)
        return -1.0;
    double v = PyFloat_AsDouble(t);
    Py_DECREF(t);
    return v;
}

static PyObject *
slow(SpliceBase *self, PyObject *chunk)
{
    return PyObject_CallMethodOneArg((PyObject *)self, slow_name, chunk);
}

/* 1: the held tail is empty; 0: it is not (or is not bytes / bytearray: the slow path judges it) */
static int
tail_empty(PyObject *tail)
{
    if (tail == NULL)
        return 0;
    if (PyBytes_CheckExact(tail))
        return PyBytes_GET_SIZE(tail) == 0;
    if (PyByteArray_CheckExact(tail))
        return PyByteArray_GET_SIZE(tail) == 0;
    return 0;
}

static int add_total(SpliceBase *self, double gap);
static PyObject *bisect_left_fn;

/* the member's AttributeError, worded as Python words it */
static int
missing(SpliceBase *self, const char *name)
{
    PyObject *r = PyObject_GetAttrString((PyObject *)self, name);
    Py_XDECREF(r);
    if (r != NULL)
        PyErr_Format(PyExc_AttributeError, "%s", name);
    return -1;
}

/* counts[bisect.bisect_left(bounds, gap)] += 1 through Python, for bounds that are not a tuple of floats */
static int
count_gap_slow(SpliceBase *self, double gap)
{
    PyObject *counts = Py_NewRef(self->counts);
    PyObject *g = PyFloat_FromDouble(gap);
    PyObject *i = g == NULL ? NULL : PyObject_CallFunctionObjArgs(bisect_left_fn, self->bounds, g, NULL);
    Py_XDECREF(g);
    PyObject *old = i == NULL ? NULL : PyObject_GetItem(counts, i);
    PyObject *one = old == NULL ? NULL : PyLong_FromLong(1);
    PyObject *more = one == NULL ? NULL : PyNumber_Add(old, one);
    int rc = more == NULL ? -1 : PyObject_SetItem(counts, i, more);
    Py_XDECREF(more); Py_XDECREF(one); Py_XDECREF(old); Py_XDECREF(i); Py_DECREF(counts);
    return rc < 0 ? -1 : add_total(self, gap);
}

/* The gap's bucket: counts[bisect_left(bounds, gap)] += 1 and gaps.total += gap; -1 with an exception set on
   failure (as the Python statement raises). */
static int
count_gap(SpliceBase *self, double gap)
{
    if (self->counts == NULL)
        return missing(self, "counts");
    if (self->bounds == NULL)
        return missing(self, "bounds");
    if (!PyTuple_CheckExact(self->bounds))   /* a list may change under __lt__/__float__: bisect itself */
        return count_gap_slow(self, gap);
    PyObject *bounds = Py_NewRef(self->bounds);   /* immutable, held: its items stay */
    PyObject **items = PySequence_Fast_ITEMS(bounds);
    Py_ssize_t lo = 0, hi = PySequence_Fast_GET_SIZE(bounds);
    while (lo < hi) {   /* bisect_left: the first bound >= gap */
        Py_ssize_t mid = (lo + hi) / 2;
        if (!PyFloat_CheckExact(items[mid])) {
            Py_DECREF(bounds);
            return count_gap_slow(self, gap);
        }
        double b = PyFloat_AS_DOUBLE(items[mid]);
        if (b < gap)
            lo = mid + 1;
        else
            hi = mid;
    }
    Py_DECREF(bounds);
    PyObject *counts = self->counts;
    if (PyList_CheckExact(counts) && lo < PyList_GET_SIZE(counts)) {   /* GapCounts' own list */
        Py_INCREF(counts);
        PyObject *item = Py_NewRef(PyList_GET_ITEM(counts, lo));
        PyObject *one = PyLong_FromLong(1);
        PyObject *more = one == NULL ? NULL : PyNumber_Add(item, one);
        Py_XDECREF(one);
        Py_DECREF(item);
        int rc = more == NULL ? -1 : PyList_SetItem(counts, lo, more);   /* steals more; bounds-checked */
        Py_DECREF(counts);
        return rc < 0 ? -1 : add_total(self, gap);
    }
    PyObject *index = PyLong_FromSsize_t(lo);
    if (index == NULL)
        return -1;
    Py_INCREF(counts);
    PyObject *old = PyObject_GetItem(counts, index);   /* IndexError past the end, as the statement raises */
    PyObject *new = NULL;
    if (old != NULL) {
        PyObject *one = PyLong_FromLong(1);
        if (one != NULL) {
            new = PyNumber_Add(old, one);
            Py_DECREF(one);
        }
        Py_DECREF(old);
    }
    int rc = new == NULL ? -1 : PyObject_SetItem(counts, index, new);
    Py_DECREF(counts);
    Py_DECREF(index);
    Py_XDECREF(new);
    if (rc < 0)
        return -1;
    return add_total(self, gap);
}

/* gaps.total += gap */
static int
add_total(SpliceBase *self, double gap)
{
    if (self->gaps == NULL)
        return missing(self, "gaps");
    PyObject *gaps = Py_NewRef(self->gaps);
    PyObject *total = PyObject_GetAttr(gaps, total_name);
    if (total == NULL) {
        Py_DECREF(gaps);
        return -1;
    }
    PyObject *g = PyFloat_FromDouble(gap);
    if (g == NULL) {
        Py_DECREF(total);
        Py_DECREF(gaps);
        return -1;
    }
    PyObject *sum = PyNumber_Add(total, g);   /* total += gap, whatever number type total is */
    Py_DECREF(total);
    Py_DECREF(g);
    if (sum == NULL) {
        Py_DECREF(gaps);
        return -1;
    }
    int rc = PyObject_SetAttr(gaps, total_name, sum);
    Py_DECREF(gaps);
    Py_DECREF(sum);
    return rc;
}

/* _Splice._emit's common case in C: `block` (past the transform) to the client; a comment, the end, or a block
   that is not bytes goes to self._emit(block); an empty one is dropped. */
static PyObject *
emit(SpliceBase *self, PyObject *block)
{
    int truth = PyObject_IsTrue(block);
    if (truth <= 0)
        return truth < 0 ? NULL : Py_NewRef(Py_None);
    if (!PyBytes_CheckExact(block))
        return PyObject_CallMethodOneArg((PyObject *)self, emit_name, block);
    const char *s = PyBytes_AS_STRING(block);
    Py_ssize_t n = PyBytes_GET_SIZE(block);
    if (self->out == NULL)
        return missing(self, "out"), NULL;
    PyObject *out = Py_NewRef(self->out);
    PyObject *ended = PyObject_GetAttr(out, ended_name);
    Py_DECREF(out);
    if (ended == NULL)
        return NULL;
    int is_ended = PyObject_IsTrue(ended);
    Py_DECREF(ended);
    if (is_ended < 0)
        return NULL;
    if (is_ended)
        Py_RETURN_NONE;   /* after the stream's end event: nothing more is for the client */
    if (s[0] == ':' || (n >= 3 && n >= self->done_len && (unsigned char)s[n - 3] == self->done_mark))
        return PyObject_CallMethodOneArg((PyObject *)self, emit_name, block);   /* comments only, or the end */
    double now = now_s(self);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    if (self->writes && count_gap(self, now - self->last) < 0)
        return NULL;
    self->last = now;
    self->writes += 1;
    Py_INCREF(block);
    Py_XSETREF(self->prev, block);
    if (self->write == NULL)
        return missing(self, "write"), NULL;
    PyObject *write = Py_NewRef(self->write);   /* held: a write that loses the client sets write = _drop */
    PyObject *r = PyObject_CallOneArg(write, block);
    Py_DECREF(write);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *
SpliceBase_data(SpliceBase *self, PyObject *chunk)
{
    if (!PyBytes_CheckExact(chunk) || !tail_empty(self->tail) || self->trigger == NULL
        || !PyBytes_CheckExact(self->trigger) || self->write == NULL || self->out == NULL)
        return slow(self, chunk);
    const char *s = PyBytes_AS_STRING(chunk);
    Py_ssize_t n = PyBytes_GET_SIZE(chunk);
    if (n < 3 || s[n - 1] != '\n' || s[n - 2] != '\n' || s[n - 3] == '\r' || memchr(s, '\r', (size_t)n) != NULL)
        return slow(self, chunk);   /* to be reframed */
    Py_ssize_t tn = PyBytes_GET_SIZE(self->trigger);
    if (tn == 0 || memmem(s, (size_t)n, PyBytes_AS_STRING(self->trigger), (size_t)tn) != NULL) {
        if (self->feed == NULL || self->prev == NULL)
            return slow(self, chunk);
        /* held for the call: the callee may set the splice's feed or prev (stop(), client_gone()) meanwhile */
        PyObject *feed = Py_NewRef(self->feed), *prev = Py_NewRef(self->prev);
        PyObject *args[2] = {chunk, prev};
        PyObject *fed = PyObject_Vectorcall(feed, args, 2, NULL);   /* the transform, as _slow calls it */
        Py_DECREF(feed);
        Py_DECREF(prev);
        if (fed == NULL)
            return NULL;
        PyObject *r = emit(self, fed);
        Py_DECREF(fed);
        return r;
    }
    return emit(self, chunk);
}

static int
SpliceBase_traverse(SpliceBase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->write);
    Py_VISIT(self->feed);
    Py_VISIT(self->trigger);
    Py_VISIT(self->prev);
    Py_VISIT(self->tail);
    Py_VISIT(self->out);
    Py_VISIT(self->gaps);
    Py_VISIT(self->bounds);
    Py_VISIT(self->counts);
    Py_VISIT(self->clock);
    return 0;
}

static int
SpliceBase_clear(SpliceBase *self)
{
    Py_CLEAR(self->write);
    Py_CLEAR(self->feed);
    Py_CLEAR(self->trigger);
    Py_CLEAR(self->prev);
    Py_CLEAR(self->tail);
    Py_CLEAR(self->out);
    Py_CLEAR(self->gaps);
    Py_CLEAR(self->bounds);
    Py_CLEAR(self->counts);
    Py_CLEAR(self->clock);
    return 0;
}

static void
SpliceBase_dealloc(SpliceBase *self)
{
    /* a static type: a Python subclass's dealloc (subtype_dealloc) drops the reference to its own type */
    PyObject_GC_UnTrack(self);
    SpliceBase_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef SpliceBase_methods[] = {
    {"data", (PyCFunction)SpliceBase_data, METH_O,
     "data(chunk) -> None: one decoder read's body (pdproxy.pd.splice.PySpliceBase.data)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef SpliceBase_members[] = {
    {"write", T_OBJECT_EX, offsetof(SpliceBase, write), 0, "callable(bytes): the client's body writer"},
    {"feed", T_OBJECT_EX, offsetof(SpliceBase, feed), 0, "callable(block, prev) -> bytes: the transform"},
    {"trigger", T_OBJECT_EX, offsetof(SpliceBase, trigger), 0, "bytes: a block holding it goes to _slow"},
    {"prev", T_OBJECT_EX, offsetof(SpliceBase, prev), 0, "bytes: the block written before"},
    {"tail", T_OBJECT_EX, offsetof(SpliceBase, tail), 0, "bytes | bytearray: an incomplete event held"},
    {"out", T_OBJECT_EX, offsetof(SpliceBase, out), 0, "the Responder (its `ended`)"},
    {"gaps", T_OBJECT_EX, offsetof(SpliceBase, gaps), 0, "GapCounts (its `total`)"},
    {"bounds", T_OBJECT_EX, offsetof(SpliceBase, bounds), 0, "tuple of float: the ITL buckets' bounds"},
    {"counts", T_OBJECT_EX, offsetof(SpliceBase, counts), 0, "list of int: the ITL buckets' counts"},
    {"clock", T_OBJECT_EX, offsetof(SpliceBase, clock), 0, "callable() -> float: monotonic seconds"},
    {"done_len", T_PYSSIZET, offsetof(SpliceBase, done_len), 0, "the shortest end event's length"},
    {"writes", T_PYSSIZET, offsetof(SpliceBase, writes), 0, "blocks written"},
    {"last", T_DOUBLE, offsetof(SpliceBase, last), 0, "monotonic seconds of the last write"},
    {"done_mark", T_INT, offsetof(SpliceBase, done_mark), 0, "the byte before the end event's blank line"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SpliceBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdproxy.pd._splice.SpliceBase",
    .tp_doc = "The per-read step of the relay's splice (pdproxy.pd.splice.PySpliceBase).",
    .tp_basicsize = sizeof(SpliceBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)SpliceBase_traverse,
    .tp_clear = (inquiry)SpliceBase_clear,
    .tp_dealloc = (destructor)SpliceBase_dealloc,
    .tp_methods = SpliceBase_methods,
    .tp_members = SpliceBase_members,
};

static struct PyModuleDef splice_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pdproxy.pd._splice",
    .m_doc = "Compiled SpliceBase (pdproxy/pd/splice.py holds the same in Python).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__splice(void)
{
    slow_name = PyUnicode_InternFromString("_slow");
    emit_name = PyUnicode_InternFromString("_emit");
    ended_name = PyUnicode_InternFromString("ended");
    total_name = PyUnicode_InternFromString("total");
    if (slow_name == NULL || emit_name == NULL || ended_name == NULL || total_name == NULL)
        return NULL;
    PyObject *time_module = PyImport_ImportModule("time");
    if (time_module == NULL)
        return NULL;
    monotonic = PyObject_GetAttrString(time_module, "monotonic");
    Py_DECREF(time_module);
    if (monotonic == NULL)
        return NULL;
    PyObject *bisect = PyImport_ImportModule("bisect");
    if (bisect == NULL)
        return NULL;
    bisect_left_fn = PyObject_GetAttrString(bisect, "bisect_left");
    Py_DECREF(bisect);
    if (bisect_left_fn == NULL)
        return NULL;
    if (PyType_Ready(&SpliceBaseType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&splice_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&SpliceBaseType);
    if (PyModule_AddObject(m, "SpliceBase", (PyObject *)&SpliceBaseType) < 0) {
        Py_DECREF(&SpliceBaseType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
