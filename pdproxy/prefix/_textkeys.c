/* pdproxy.prefix._textkeys: chunk_keys(), the compiled loop of pdproxy/prefix/index.py text_keys (same chunks, same
   keys; without this module text_keys runs its own Python loop, and tests/prefix/test_text_keys_compiled.py holds
   the two to each other).

   chunk_keys(parts, chunk_chars, growth, mark, seed, digest) -> (keys, ends)

   ``parts``: a list of bytes whose concatenation is the rendered prompt (pdproxy/prefix/routing.py render_parts);
   ``chunk_chars`` >= 1: the first chunks' length in bytes; ``growth``: past ``chunk_chars * growth`` bytes a chunk is
   1/growth of the bytes before it; ``mark``: the byte that ends a chunk when it lies at least half the chunk's
   length (and ``chunk_chars``) into it (MESSAGE_MARK); ``seed``: the namespace's root key (an int); ``digest``:
   ``xxhash.xxh3_64_intdigest``, called as ``digest(chunk, previous key)`` for every chunk, so each key chains the
   one before it.  A chunk inside one part is passed as a read-only memoryview of it (no copy; the view holds the
   part, so a digest may keep it); one spanning parts is copied into one bytes object (XXH3's one-shot digest of
   the bytes is its streaming digest, which the Python loop uses).  ``keys``: the digests, in order; ``ends[i]``:
   the bytes the first i + 1 chunks cover.  A prompt shorter than ``chunk_chars`` has no chunk.  Errors: TypeError
   for a part that is not bytes, or what ``digest`` raises.  The loop reads a tuple of the parts taken at the
   start, so a ``digest`` that changes the list (or drops the caller's references to the parts) changes nothing
   under it.

   The loop is the Python one's, step for step; what it saves is the interpreter's ~0.5 µs a chunk (a 250 KB chat
   has 49 chunks, an agent's 65 KB body of 18 parts 38). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define NO_MARK ((Py_ssize_t)1 << 62)

typedef struct {
    PyObject *parts;       /* a tuple of the parts (owned: the caller's list may change while ``digest`` runs) */
    Py_ssize_t count;      /* parts in it */
    Py_ssize_t *starts;    /* starts[i]: offset of part i in the concatenation; starts[count]: its size */
    PyObject *view;        /* a memoryview of part ``view_of`` (owned, or NULL): chunks inside it are its slices */
    Py_ssize_t view_of;
} Text;

/* Index of the part holding offset `at` (0 <= at < size): the last i with starts[i] <= at (binary search). */
static Py_ssize_t
part_of(const Text *t, Py_ssize_t at)
{
    Py_ssize_t lo = 0, hi = t->count - 1;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) / 2;
        if (t->starts[mid] <= at)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Offset of the first `mark` byte at or after `low`, or NO_MARK. */
static Py_ssize_t
find_mark(const Text *t, Py_ssize_t low, char mark)
{
    Py_ssize_t size = t->starts[t->count];
    if (low >= size)
        return NO_MARK;
    for (Py_ssize_t i = part_of(t, low); i < t->count; i++) {
        PyObject *p = PyTuple_GET_ITEM(t->parts, i);
        const char *s = PyBytes_AS_STRING(p);
        Py_ssize_t from = low > t->starts[i] ? low - t->starts[i] : 0;
        Py_ssize_t n = PyBytes_GET_SIZE(p);
        if (from >= n)
            continue;
        const char *hit = memchr(s + from, mark, (size_t)(n - from));
        if (hit != NULL)
            return t->starts[i] + (hit - s);
    }
    return NO_MARK;
}

/* The bytes [start, end) of the text as an object `digest` takes: a memoryview inside one part, else a copy. */
static PyObject *
chunk_of(Text *t, Py_ssize_t start, Py_ssize_t end)
{
    Py_ssize_t i = part_of(t, start);
    PyObject *p = PyTuple_GET_ITEM(t->parts, i);
    if (end <= t->starts[i + 1]) {   /* a slice of a view of the part: it holds the part as long as it lives */
        if (t->view == NULL || t->view_of != i) {
            Py_CLEAR(t->view);
            t->view = PyMemoryView_FromObject(p);
            if (t->view == NULL)
                return NULL;
            t->view_of = i;
        }
        return PySequence_GetSlice(t->view, start - t->starts[i], end - t->starts[i]);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, end - start);
    if (out == NULL)
        return NULL;
    char *w = PyBytes_AS_STRING(out);
    Py_ssize_t at = start;
    while (at < end) {
        p = PyTuple_GET_ITEM(t->parts, i);
        Py_ssize_t from = at - t->starts[i];
        Py_ssize_t upto = (end < t->starts[i + 1] ? end : t->starts[i + 1]) - t->starts[i];
        memcpy(w, PyBytes_AS_STRING(p) + from, (size_t)(upto - from));
        w += upto - from;
        at = t->starts[i] + upto;
        i++;
    }
    return out;
}

static PyObject *
chunk_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "chunk_keys(parts, chunk_chars, growth, mark, seed, digest) takes 6 arguments");
        return NULL;
    }
    PyObject *parts = args[0];
    if (!PyList_CheckExact(parts)) {
        PyErr_SetString(PyExc_TypeError, "parts must be a list of bytes");
        return NULL;
    }
    Py_ssize_t chunk = PyLong_AsSsize_t(args[1]);
    if (chunk == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t growth = PyLong_AsSsize_t(args[2]);
    if (growth == -1 && PyErr_Occurred())
        return NULL;
    long mark = PyLong_AsLong(args[3]);
    if (mark == -1 && PyErr_Occurred())
        return NULL;
    if (chunk < 1 || growth < 1 || mark < 0 || mark > 255) {
        PyErr_SetString(PyExc_ValueError, "chunk_chars and growth must be >= 1, mark a byte");
        return NULL;
    }
    PyObject *digest = args[5];
    Text t = {PyList_AsTuple(parts), PyList_GET_SIZE(parts), NULL, NULL, -1};
    if (t.parts == NULL)
        return NULL;
    PyObject *keys = NULL, *ends = NULL, *seed = Py_NewRef(args[4]), *result = NULL;
    if (t.count == 0) {
        keys = PyList_New(0);
        ends = PyList_New(0);
        goto out;
    }
    t.starts = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(t.count + 1));
    if (t.starts == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    t.starts[0] = 0;
    for (Py_ssize_t i = 0; i < t.count; i++) {
        PyObject *p = PyTuple_GET_ITEM(t.parts, i);
        if (!PyBytes_Check(p)) {
            PyErr_SetString(PyExc_TypeError, "parts must be a list of bytes");
            goto fail;
        }
        t.starts[i + 1] = t.starts[i] + PyBytes_GET_SIZE(p);
    }
    keys = PyList_New(0);
    ends = PyList_New(0);
    if (keys == NULL || ends == NULL)
        goto fail;
    Py_ssize_t size = t.starts[t.count];
    if (chunk > size)                              /* shorter than one chunk: no key (and no sum below overflows) */
        goto out;
    Py_ssize_t start = 0, step = chunk, found = -1;
    Py_ssize_t floor = chunk > PY_SSIZE_T_MAX / growth ? PY_SSIZE_T_MAX : chunk * growth;
    while (start < size) {
        Py_ssize_t end = start + step;
        if (found < end) {                         /* the usual chunk has no mark before its end */
            Py_ssize_t half = step >> 1;
            Py_ssize_t low = start + (half > chunk ? half : chunk);
            if (found < low)
                found = find_mark(&t, low, (char)mark);
            if (found < end)
                end = found;
        }
        if (end > size) {
            if (start == 0)                        /* shorter than one chunk: no key */
                break;
            end = size;
        }
        if (end <= start) {                        /* cannot happen (a mark is found at or after low > start) */
            PyErr_SetString(PyExc_SystemError, "chunk_keys: a chunk did not advance");
            goto fail;
        }
        PyObject *piece = chunk_of(&t, start, end);
        if (piece == NULL)
            goto fail;
        PyObject *call[2] = {piece, seed};
        PyObject *key = PyObject_Vectorcall(digest, call, 2, NULL);
        Py_DECREF(piece);
        if (key == NULL)
            goto fail;
        Py_SETREF(seed, key);
        PyObject *end_obj = PyLong_FromSsize_t(end);
        if (end_obj == NULL || PyList_Append(keys, key) < 0 || PyList_Append(ends, end_obj) < 0) {
            Py_XDECREF(end_obj);
            goto fail;
        }
        Py_DECREF(end_obj);
        start = end;
        step = end >= floor ? end / growth : chunk;
    }
out:
    if (keys != NULL && ends != NULL)
        result = PyTuple_Pack(2, keys, ends);
fail:
    PyMem_Free(t.starts);
    Py_XDECREF(t.view);
    Py_DECREF(t.parts);
    Py_XDECREF(keys);
    Py_XDECREF(ends);
    Py_DECREF(seed);
    return result;
}

static PyMethodDef textkeys_functions[] = {
    {"chunk_keys", (PyCFunction)(void (*)(void))chunk_keys, METH_FASTCALL,
     "chunk_keys(parts, chunk_chars, growth, mark, seed, digest) -> (keys, ends): text_keys' chunks and keys."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef textkeys_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pdproxy.prefix._textkeys",
    .m_doc = "Compiled loop of text keys (pdproxy/prefix/index.py text_keys holds the same in Python).",
    .m_size = 0,
    .m_methods = textkeys_functions,
};

PyMODINIT_FUNC
PyInit__textkeys(void)
{
    return PyModuleDef_Init(&textkeys_module);
}
