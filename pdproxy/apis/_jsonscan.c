/* pdproxy.apis._jsonscan: nests_within(raw, limit), the compiled nesting check of a client's JSON body
   (pdproxy/apis/request.py load_json; without this module it uses its bracket bound and padded parse instead),
   wide_integer(raw), its check for integers outside 64 bits (same caller; Python twin request.py_wide_integer),
   and container_end(raw, start), the end of one object or array of a body already parsed (pdproxy/apis/
   kv_transfer.py top_level_members, which cuts proxy-owned members out of a client's bytes; its Python twin is
   kv_transfer.py_container_end, whose regex loop cost ~0.4 s of the event loop per 1.5 MB body of 490,000 empty
   lists).

   wide_integer(raw) -> bool: whether raw holds, outside its strings, an integer literal outside [-2**63, 2**64 - 1]
   (load_json refuses such a body: orjson 3.13 reads those integers as floats, so a leg pdproxy re-serialises would
   carry another value than the client's bytes; Python's json, which vLLM reads bodies with, keeps them exact).  A
   number token is the run of bytes from a minus or digit through digits, signs, points and exponent marks; an
   integer is one without a point or exponent.  Strings are skipped as below; one pass, no allocation.  For bytes
   that are not JSON any answer (the parser refuses them).

   container_end(raw, start) -> int: the index just past the bracket that closes the object or array opening at
   raw[start], strings skipped as nests_within skips them; ValueError when raw[start] opens none or nothing closes
   it.  Brackets are counted, not matched by kind: the body is JSON (orjson parsed it).  One pass, as below.

   nests_within(raw, limit) -> bool: False when some bracket of ``raw`` outside its strings ([ or { opening, ] or }
   closing) sits deeper than ``limit`` levels (``[[1]]`` is 2 deep), else True.  For a body that is JSON this is its
   nesting depth exactly (a JSON string holds no unescaped quote, so the quotes bound the strings); for any other
   bytes it is some answer, never an error: bytes it passes go on to the parser, which refuses them; bytes it
   refuses get load_json's "too deep" 400 (json_invalid) where the Python path, parsing first, may name another
   fault of the same body (a syntax error, a byte-order mark) — a 400 either way.  One pass, no recursion, no
   allocation: inside a string the next quote is found with memchr and taken as the string's end unless an odd
   run of backslashes stands before it (each run is counted once, by the quote right after it); outside strings a
   table marks the five bytes that matter.  ~5 µs for a 300 KB one-message chat, ~10 µs for a 70 KB agent body of
   400 brackets, where the padded parse costs ~100 µs more than orjson's own (loadtest/request_cost_bench.py). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

enum { OTHER = 0, OPEN = 1, CLOSE = 2, QUOTE = 3 };

static const unsigned char KIND[256] = {
    ['['] = OPEN, ['{'] = OPEN, [']'] = CLOSE, ['}'] = CLOSE, ['"'] = QUOTE,
};

/* The index just past the quote that ends the string whose body starts at `start` (just after its opening
   quote), or n when none does.  The backslashes counted back from a quote stop at the string's start or at any
   earlier quote (not a backslash), so each byte is counted at most once. */
static Py_ssize_t
string_end(const char *s, Py_ssize_t n, Py_ssize_t start)
{
    Py_ssize_t i = start;
    while (i < n) {
        const char *q = memchr(s + i, '"', (size_t)(n - i));
        if (q == NULL)
            return n;
        Py_ssize_t at = q - s;
        Py_ssize_t k = at;
        while (k > start && s[k - 1] == '\\')
            k--;
        if (((at - k) & 1) == 0)
            return at + 1;
        i = at + 1;  /* an escaped quote: the string goes on */
    }
    return n;
}

/* Both functions' arguments (raw, a number): the number in *num and raw's bytes held in *view (the caller
   releases it); -1 with a Python error set when they are not that. */
static int
buffer_and_number(PyObject *const *args, Py_ssize_t nargs, const char *usage, Py_buffer *view, Py_ssize_t *num)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s takes 2 arguments", usage);
        return -1;
    }
    *num = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (*num == -1 && PyErr_Occurred())
        return -1;
    return PyObject_GetBuffer(args[0], view, PyBUF_SIMPLE);
}

static PyObject *
nests_within(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    Py_ssize_t limit;
    Py_buffer view;
    if (buffer_and_number(args, nargs, "nests_within(raw, limit)", &view, &limit) < 0)
        return NULL;
    const char *s = (const char *)view.buf;
    Py_ssize_t n = view.len;
    Py_ssize_t depth = 0;
    int within = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        switch (KIND[(unsigned char)s[i]]) {
        case OPEN:
            if (++depth > limit) {
                within = 0;
                goto done;
            }
            break;
        case CLOSE:
            if (depth > 0)
                depth--;
            break;
        case QUOTE:
            i = string_end(s, n, i + 1) - 1;  /* the loop's i++ steps past the closing quote */
            break;
        default:
            break;
        }
    }
done:
    PyBuffer_Release(&view);
    return PyBool_FromLong(within);
}

static PyObject *
container_end(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    Py_ssize_t start;
    Py_buffer view;
    if (buffer_and_number(args, nargs, "container_end(raw, start)", &view, &start) < 0)
        return NULL;
    const char *s = (const char *)view.buf;
    Py_ssize_t n = view.len;
    Py_ssize_t end = -1;
    if (start >= 0 && start < n && KIND[(unsigned char)s[start]] == OPEN) {
        Py_ssize_t depth = 0;
        for (Py_ssize_t i = start; i < n; i++) {
            switch (KIND[(unsigned char)s[i]]) {
            case OPEN:
                depth++;
                break;
            case CLOSE:
                if (--depth == 0) {
                    end = i + 1;
                    goto done;
                }
                break;
            case QUOTE:
                i = string_end(s, n, i + 1) - 1;
                break;
            default:
                break;
            }
        }
    }
done:
    PyBuffer_Release(&view);
    if (end < 0) {
        PyErr_SetString(PyExc_ValueError, "unbalanced brackets in request body");
        return NULL;
    }
    return PyLong_FromSsize_t(end);
}

/* Bytes of a JSON number token: digits, sign, fraction point, exponent mark (an integer is a token of digits and
   an optional leading minus only). */
static const unsigned char NUMBER[256] = {
    ['0'] = 1, ['1'] = 1, ['2'] = 1, ['3'] = 1, ['4'] = 1, ['5'] = 1, ['6'] = 1, ['7'] = 1, ['8'] = 1, ['9'] = 1,
    ['-'] = 1, ['+'] = 1, ['.'] = 1, ['e'] = 1, ['E'] = 1,
};

/* Whether the integer token s[0..len) (digits after an optional '-', no '.', 'e' or 'E') lies outside
   [-2**63, 2**64 - 1].  JSON has no leading zeros, so a longer run of digits is a larger magnitude. */
static int
outside_64_bits(const char *s, Py_ssize_t len)
{
    static const char MIN_ABS[] = "9223372036854775808";   /* 2**63: the magnitude of int64's least value */
    static const char MAX_U64[] = "18446744073709551615";  /* 2**64 - 1 */
    int negative = s[0] == '-';
    const char *digits = s + negative;
    Py_ssize_t n = len - negative;
    const char *limit = negative ? MIN_ABS : MAX_U64;
    Py_ssize_t limit_len = negative ? 19 : 20;
    if (n != limit_len)
        return n > limit_len;
    return memcmp(digits, limit, (size_t)n) > 0;
}

static PyObject *
wide_integer(PyObject *module, PyObject *raw)
{
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const char *s = (const char *)view.buf;
    Py_ssize_t n = view.len;
    int wide = 0;
    Py_ssize_t i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"') {
            i = string_end(s, n, i + 1);
        } else if (c == '-' || (unsigned char)(c - '0') <= 9) {   /* a number token starts */
            Py_ssize_t start = i++;
            while (i < n && (unsigned char)(s[i] - '0') <= 9)
                i++;
            if (i < n && NUMBER[(unsigned char)s[i]]) {   /* a point, an exponent: not an integer; its rest */
                while (i < n && NUMBER[(unsigned char)s[i]])
                    i++;
            } else if (i - start >= 19 && outside_64_bits(s + start, i - start)) {
                wide = 1;
                break;
            }
        } else {
            i++;
        }
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(wide);
}

static PyMethodDef jsonscan_functions[] = {
    {"wide_integer", (PyCFunction)wide_integer, METH_O,
     "wide_integer(raw) -> bool: raw holds, outside its strings, an integer outside [-2**63, 2**64 - 1]."},
    {"nests_within", (PyCFunction)(void (*)(void))nests_within, METH_FASTCALL,
     "nests_within(raw, limit) -> bool: no bracket of raw outside its strings is deeper than limit levels."},
    {"container_end", (PyCFunction)(void (*)(void))container_end, METH_FASTCALL,
     "container_end(raw, start) -> int: the index just past the object or array opening at raw[start]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef jsonscan_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pdproxy.apis._jsonscan",
    .m_doc = "Compiled scans of a JSON body: its nesting and integers past 64 bits (pdproxy/apis/request.py "
             "load_json) and a container's end (pdproxy/apis/kv_transfer.py top_level_members).",
    .m_size = 0,
    .m_methods = jsonscan_functions,
};

PyMODINIT_FUNC
PyInit__jsonscan(void)
{
    return PyModuleDef_Init(&jsonscan_module);
}
