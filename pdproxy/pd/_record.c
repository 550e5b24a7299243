/* pdproxy.pd._record: the compiled form of pdproxy.pd.record.PyRecordBase (same names, same results).

   RecordBase.feed(block, prev=b"") is the per-read step of a continuable stream's first decode leg
   (docs/stream-continuation.md, "The record in compiled code"): for a block whose last event is a chat / completions
   token chunk carrying ids (it ends with ``]}]}`` and a blank line) and holding none of ``unsafe``, it records the
   block's ids and gives the client's bytes with every ``token_ids":[...]`` array written as ``token_ids":null`` (or,
   with ``keep``, records and gives the block as it is); any other block goes to ``self._slow(block, prev)``. The
   rewrite is the one of the regular expression ``token_ids":\[([0-9,\s]*)\]`` (pdproxy/pd/record.py): the recorded ids
   are the matches' groups joined with ``,``.

   Pure C over the block's bytes: two linear scans (the second reuses the first's first MATCHES arrays), no Python
   code run but the ``tail`` callable and ``_slow``.  The block comes from a decoder, not a client; every index below
   stays inside [0, n). */

#define _GNU_SOURCE  /* memmem */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

static const char TOKEN_END[] = "]}]}\n\n";        /* 6 bytes */
static const char IDS_KEY[] = "token_ids\":[";     /* 12 bytes: also matches "prompt_token_ids":[ */
static const char NULL_WORD[] = "null";            /* 4 bytes */
#define TOKEN_END_LEN 6
#define IDS_KEY_LEN 12
#define NULL_LEN 4
#define MATCHES 32  /* arrays of one block located in the first scan; more are found again in the second */
#define TAIL_BYTES 4096  /* what the ring keeps of a larger read: its events that start in its last 4 KiB */

typedef struct {
    PyObject_HEAD
    PyObject *blocks;   /* list: the record */
    PyObject *tail;     /* callable(block): the ring of the last reads */
    PyObject *unsafe;   /* tuple of bytes: a block holding one goes to _slow */
    char fast;          /* the fast path is on (after the first block) */
    char keep;          /* the client asked for the ids: blocks are recorded and given unchanged */
} RecordBase;

static PyObject *slow_name;  /* interned "_slow" */

/* bytes of the regular expression class [0-9,\s] (Python's \s for bytes: space, \t, \n, \r, \f, \v), as a
   table: one load per byte and no branch but the loop's own (a prompt's ids array is ~6 bytes a token) */
static const unsigned char ID_BYTE[256] = {
    ['0'] = 1, ['1'] = 1, ['2'] = 1, ['3'] = 1, ['4'] = 1, ['5'] = 1, ['6'] = 1, ['7'] = 1, ['8'] = 1, ['9'] = 1,
    [','] = 1, [' '] = 1, ['\t'] = 1, ['\n'] = 1, ['\v'] = 1, ['\f'] = 1, ['\r'] = 1,
};

/* The next ids array at or after `from`: returns the index of the key's start (its '[' is at +11) and sets *end to
   the index of its ']', or returns -1.  A key ends with the only '[' it holds, so the candidates are the '[' bytes
   in order (memchr: a token chunk has two), each checked for the 11 key bytes before it and id bytes up to a ']';
   the expression's scan finds the same matches (after a failed candidate it tries later starts, after a match it
   goes on after the ']'). */
static Py_ssize_t
next_ids(const char *s, Py_ssize_t n, Py_ssize_t from, Py_ssize_t *end)
{
    Py_ssize_t i = from + IDS_KEY_LEN - 1;  /* the first place a '[' can end a key starting at `from` */
    while (i < n) {
        const char *p = memchr(s + i, '[', (size_t)(n - i));
        if (p == NULL)
            return -1;
        i = p - s;
        Py_ssize_t at = i - (IDS_KEY_LEN - 1);
        if (memcmp(s + at, IDS_KEY, IDS_KEY_LEN - 1) == 0) {
            Py_ssize_t b = i + 1;
            while (b < n && ID_BYTE[(unsigned char)s[b]])
                b++;
            if (b < n && s[b] == ']') {
                *end = b;
                return at;
            }
        }
        i++;
    }
    return -1;
}

/* The part of a block the ring keeps (pdproxy.pd.record.py_last_events): the whole block up to TAIL_BYTES; of a
   larger one (a read of many events: a stream at full speed, a client that paused it) the events that start in its
   last TAIL_BYTES bytes, or its last event alone when none does.  A new reference. */
static PyObject *
last_events_of(PyObject *block, const char *s, Py_ssize_t n)
{
    if (n <= TAIL_BYTES)
        return Py_NewRef(block);
    Py_ssize_t from = n - TAIL_BYTES - 2;  /* a blank line ending at or after the window's start */
    if (from < 0)
        from = 0;                            /* n == TAIL_BYTES + 1 */
    const char *p = memmem(s + from, (size_t)(n - from), "\n\n", 2);
    Py_ssize_t start = p != NULL ? (p - s) + 2 : n;
    if (start >= n) {  /* no event starts in the window: from after the last blank line before the block's end */
        start = 0;
        for (Py_ssize_t k = n - 3; k >= 1; k--) {
            if (s[k] == '\n' && s[k - 1] == '\n') {
                start = k + 1;
                break;
            }
        }
    }
    return PyBytes_FromStringAndSize(s + start, n - start);
}

static PyObject *
last_events(PyObject *module, PyObject *block)
{
    if (!PyBytes_Check(block)) {
        PyErr_SetString(PyExc_TypeError, "last_events(block) takes bytes");
        return NULL;
    }
    return last_events_of(block, PyBytes_AS_STRING(block), PyBytes_GET_SIZE(block));
}

static int
ring(RecordBase *self, PyObject *block)
{
    PyObject *kept = PyBytes_GET_SIZE(block) <= TAIL_BYTES ? Py_NewRef(block)
        : last_events_of(block, PyBytes_AS_STRING(block), PyBytes_GET_SIZE(block));
    if (kept == NULL)
        return -1;
    PyObject *r = PyObject_CallOneArg(self->tail, kept);
    Py_DECREF(kept);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The rewrite of a fast block: NULL with no exception when it holds no ids array (the caller goes slow). */
static PyObject *
rewrite(RecordBase *self, PyObject *block, const char *s, Py_ssize_t n)
{
    /* pass 1: find the arrays (the first MATCHES kept) and count their ids' bytes */
    Py_ssize_t starts[MATCHES], ends[MATCHES];
    Py_ssize_t count = 0, ids_len = 0, pos = 0, at, b;
    while ((at = next_ids(s, n, pos, &b)) >= 0) {
        if (count < MATCHES) {
            starts[count] = at;
            ends[count] = b;
        }
        count++;
        ids_len += b - (at + IDS_KEY_LEN);
        pos = b + 1;
    }
    if (count == 0)
        return NULL;
    /* pass 2: the client's bytes, and the ids (joined with ",") onto the record: the bytearray that ends it (the
       ids of the token blocks since the last block kept whole) after a ",", or a new one */
    Py_ssize_t out_len = n + count * NULL_LEN - ids_len - 2 * count;  /* "[ids]" -> "null" */
    PyObject *out = PyBytes_FromStringAndSize(NULL, out_len);
    if (out == NULL)
        return NULL;
    Py_ssize_t nb = PyList_GET_SIZE(self->blocks);
    PyObject *last = nb > 0 ? PyList_GET_ITEM(self->blocks, nb - 1) : NULL;
    char *d;
    if (last != NULL && PyByteArray_CheckExact(last)) {
        Py_ssize_t old = PyByteArray_GET_SIZE(last);
        if (PyByteArray_Resize(last, old + ids_len + count) < 0) {  /* amortized: a bytearray over-allocates */
            Py_DECREF(out);
            return NULL;
        }
        d = PyByteArray_AS_STRING(last) + old;
        *d++ = ',';
    }
    else {
        PyObject *ids = PyByteArray_FromStringAndSize(NULL, ids_len + count - 1);
        if (ids == NULL || PyList_Append(self->blocks, ids) < 0) {
            Py_XDECREF(ids);
            Py_DECREF(out);
            return NULL;
        }
        d = PyByteArray_AS_STRING(ids);
        Py_DECREF(ids);  /* the record holds it */
    }
    char *o = PyBytes_AS_STRING(out);
    Py_ssize_t done = 0;
    for (Py_ssize_t m = 0; m < count; m++) {
        if (m < MATCHES) {
            at = starts[m];
            b = ends[m];
        }
        else {
            at = next_ids(s, n, done, &b);  /* found in pass 1: the next one after the last */
        }
        Py_ssize_t a = at + IDS_KEY_LEN;
        Py_ssize_t keep_to = at + IDS_KEY_LEN - 1;  /* up to and without the '[' */
        memcpy(o, s + done, (size_t)(keep_to - done));
        o += keep_to - done;
        memcpy(o, NULL_WORD, NULL_LEN);
        o += NULL_LEN;
        if (m > 0)
            *d++ = ',';
        memcpy(d, s + a, (size_t)(b - a));
        d += b - a;
        done = b + 1;
    }
    memcpy(o, s + done, (size_t)(n - done));
    if (ring(self, block) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* null_ids(block) -> bytes: every ids array written as null (``IDS_RE.sub(NULL_IDS, block)``, pdproxy/pd/record.py)
   in two memchr scans: the general path's rewrite (a first block carries the prompt's ids: ~400 KB of them at 64K
   tokens, where the expression steps through every byte). */
static PyObject *
null_ids(PyObject *module, PyObject *block)
{
    if (!PyBytes_Check(block)) {
        PyErr_SetString(PyExc_TypeError, "null_ids(block) takes bytes");
        return NULL;
    }
    const char *s = PyBytes_AS_STRING(block);
    Py_ssize_t n = PyBytes_GET_SIZE(block);
    Py_ssize_t starts[MATCHES], ends[MATCHES];
    Py_ssize_t count = 0, gone = 0, pos = 0, at, b;
    while ((at = next_ids(s, n, pos, &b)) >= 0) {  /* pass 1: the output's length (the first MATCHES kept) */
        if (count < MATCHES) {
            starts[count] = at;
            ends[count] = b;
        }
        count++;
        gone += b + 1 - (at + IDS_KEY_LEN - 1);     /* "[ids]" */
        pos = b + 1;
    }
    if (count == 0)
        return Py_NewRef(block);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n - gone + count * NULL_LEN);
    if (out == NULL)
        return NULL;
    char *o = PyBytes_AS_STRING(out);
    pos = 0;
    for (Py_ssize_t m = 0; m < count; m++) {       /* pass 2: the same matches, copied around */
        if (m < MATCHES) {
            at = starts[m];
            b = ends[m];
        }
        else {
            at = next_ids(s, n, pos, &b);          /* found in pass 1: the next one after the last */
        }
        Py_ssize_t keep_to = at + IDS_KEY_LEN - 1;  /* up to and without the '[' */
        memcpy(o, s + pos, (size_t)(keep_to - pos));
        o += keep_to - pos;
        memcpy(o, NULL_WORD, NULL_LEN);
        o += NULL_LEN;
        pos = b + 1;
    }
    memcpy(o, s + pos, (size_t)(n - pos));
    return out;
}

static PyObject *
slow(RecordBase *self, PyObject *block, PyObject *prev)
{
    PyObject *call[3] = {(PyObject *)self, block, prev};
    if (prev == NULL) {
        call[2] = PyBytes_FromStringAndSize(NULL, 0);
        if (call[2] == NULL)
            return NULL;
        PyObject *r = PyObject_VectorcallMethod(slow_name, call, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(call[2]);
        return r;
    }
    return PyObject_VectorcallMethod(slow_name, call, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* feed(block, prev=b""): positional or by keyword, as the Python twin */
static PyObject *
RecordBase_feed(RecordBase *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *block = nargs > 0 ? args[0] : NULL, *prev = nargs > 1 ? args[1] : NULL;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    int bad = nargs > 2;
    for (Py_ssize_t i = 0; i < nkw && !bad; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        if (block == NULL && PyUnicode_CompareWithASCIIString(name, "block") == 0)
            block = args[nargs + i];
        else if (prev == NULL && PyUnicode_CompareWithASCIIString(name, "prev") == 0)
            prev = args[nargs + i];
        else
            bad = 1;
    }
    if (bad || block == NULL) {
        PyErr_SetString(PyExc_TypeError, "feed(block, prev=b'') takes a block and an optional prev");
        return NULL;
    }
    if (!self->fast || !PyBytes_CheckExact(block) || self->blocks == NULL || !PyList_CheckExact(self->blocks)
        || self->tail == NULL || self->unsafe == NULL || !PyTuple_CheckExact(self->unsafe))
        return slow(self, block, prev);
    const char *s = PyBytes_AS_STRING(block);
    Py_ssize_t n = PyBytes_GET_SIZE(block);
    if (n < TOKEN_END_LEN || memcmp(s + n - TOKEN_END_LEN, TOKEN_END, TOKEN_END_LEN) != 0)
        return slow(self, block, prev);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->unsafe); i++) {
        PyObject *word = PyTuple_GET_ITEM(self->unsafe, i);
        if (!PyBytes_Check(word) || PyBytes_GET_SIZE(word) == 0
            || memmem(s, (size_t)n, PyBytes_AS_STRING(word), (size_t)PyBytes_GET_SIZE(word)) != NULL)
            return slow(self, block, prev);
    }
    if (self->keep) {
        if (PyList_Append(self->blocks, block) < 0 || ring(self, block) < 0)
            return NULL;
        return Py_NewRef(block);
    }
    PyObject *out = rewrite(self, block, s, n);
    if (out == NULL && !PyErr_Occurred())
        return slow(self, block, prev);
    return out;
}

static int
RecordBase_traverse(RecordBase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->blocks);
    Py_VISIT(self->tail);
    Py_VISIT(self->unsafe);
    return 0;
}

static int
RecordBase_clear(RecordBase *self)
{
    Py_CLEAR(self->blocks);
    Py_CLEAR(self->tail);
    Py_CLEAR(self->unsafe);
    return 0;
}

static void
RecordBase_dealloc(RecordBase *self)
{
    /* a static type: a Python subclass's dealloc (subtype_dealloc) drops the reference to its own type */
    PyObject_GC_UnTrack(self);
    RecordBase_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef RecordBase_methods[] = {
    {"feed", (PyCFunction)(void (*)(void))RecordBase_feed, METH_FASTCALL | METH_KEYWORDS,
     "feed(block, prev=b'') -> bytes: the block for the client (pdproxy.pd.record.PyRecordBase.feed)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef RecordBase_members[] = {
    {"blocks", T_OBJECT_EX, offsetof(RecordBase, blocks), 0, "list: the record"},
    {"tail", T_OBJECT_EX, offsetof(RecordBase, tail), 0, "callable(block): the ring of the last reads"},
    {"unsafe", T_OBJECT_EX, offsetof(RecordBase, unsafe), 0, "tuple of bytes that send a block the slow way"},
    {"fast", T_BOOL, offsetof(RecordBase, fast), 0, "the fast path is on"},
    {"keep", T_BOOL, offsetof(RecordBase, keep), 0, "blocks are recorded and given unchanged"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject RecordBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdproxy.pd._record.RecordBase",
    .tp_doc = "The per-read record and id rewrite of a continuable stream (pdproxy.pd.record.PyRecordBase).",
    .tp_basicsize = sizeof(RecordBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)RecordBase_traverse,
    .tp_clear = (inquiry)RecordBase_clear,
    .tp_dealloc = (destructor)RecordBase_dealloc,
    .tp_methods = RecordBase_methods,
    .tp_members = RecordBase_members,
};

static PyMethodDef record_functions[] = {
    {"null_ids", (PyCFunction)null_ids, METH_O,
     "null_ids(block) -> bytes: every token_ids array written as null (pdproxy.pd.record.py_null_ids)."},
    {"last_events", (PyCFunction)last_events, METH_O,
     "last_events(block) -> bytes: what the ring keeps of a block (pdproxy.pd.record.py_last_events)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef record_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pdproxy.pd._record",
    .m_doc = "Compiled RecordBase, null_ids and last_events (pdproxy/pd/record.py holds the same in Python).",
    .m_size = -1,
    .m_methods = record_functions,
};

PyMODINIT_FUNC
PyInit__record(void)
{
    slow_name = PyUnicode_InternFromString("_slow");
    if (slow_name == NULL)
        return NULL;
    if (PyType_Ready(&RecordBaseType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&record_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RecordBaseType);
    if (PyModule_AddObject(m, "RecordBase", (PyObject *)&RecordBaseType) < 0) {
        Py_DECREF(&RecordBaseType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
