/* Files' stamps, many in one call, without the GIL.

   The dali backend hands DALI a batch's rows of a path table and checks, once a pass, that each file is the one its
   verdict was made from (gpupipe/backends/dali_files.py: a stamp is the file's device, inode, size, modification and
   change times, mixed into one number). From Python that is a stat() and a tuple a file, on the thread that feeds
   DALI, holding the GIL that DALI's own threads wait for when they finish an operator; sent to the header-scan
   processes instead, it was a message a few batches (the pool's threads woken, a pipe written). Here a batch's files
   are stat-ed in one call with the GIL let go: microseconds a batch.

   The mix is stamp_key()'s in dali_files.py, bit for bit (a test holds them together): each field, as a 64-bit
   unsigned number, xor-ed into the running value and spread by splitmix64's finaliser. 0 means the file cannot be
   stat-ed (gone), and no stamp is -1 (a sample not judged yet) or 0. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v;
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ULL;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBULL;
    return h ^ (h >> 31);
}

/* The stamp of the file at `path` (NUL-terminated): 0 when it cannot be stat-ed. */
static int64_t stamp(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0)
        return 0;
    uint64_t h = 0x9E3779B97F4A7C15ULL;
    h = mix(h, (uint64_t)st.st_dev);
    h = mix(h, (uint64_t)st.st_ino);
    h = mix(h, (uint64_t)st.st_size);
    h = mix(h, (uint64_t)st.st_mtim.tv_sec * 1000000000ULL + (uint64_t)st.st_mtim.tv_nsec);
    h = mix(h, (uint64_t)st.st_ctim.tv_sec * 1000000000ULL + (uint64_t)st.st_ctim.tv_nsec);
    int64_t key = (int64_t)h;
    return key == 0 || key == -1 ? 1 : key;
}

/* Whether a path starting at byte `at`, `len` bytes long, lies inside a buffer of `size` bytes (no sum that can
   overflow). */
static int inside(int64_t at, int64_t len, Py_ssize_t size) {
    return at >= 0 && len >= 0 && at <= size && len <= size - at;
}

static int take(PyObject *obj, Py_buffer *view, int writable, const char *format, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) != 0)
        return -1;
    if (strcmp(format, "q") == 0 ? view->itemsize != 8 || (strcmp(view->format, "q") && strcmp(view->format, "l"))
                                 : view->itemsize != 1) {
        PyErr_Format(PyExc_TypeError, "%s: a contiguous array of %s", name, strcmp(format, "q") ? "bytes" : "int64");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *stamps(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *starts_obj, *lengths_obj, *index_obj, *out_obj, *result = NULL;
    if (!PyArg_ParseTuple(args, "OOOOO", &buf_obj, &starts_obj, &lengths_obj, &index_obj, &out_obj))
        return NULL;
    Py_buffer buf, starts, lengths, index, out;
    if (take(buf_obj, &buf, 0, "B", "buffer"))
        return NULL;
    if (take(starts_obj, &starts, 0, "q", "starts"))
        goto no_starts;
    if (take(lengths_obj, &lengths, 0, "q", "lengths"))
        goto no_lengths;
    if (take(index_obj, &index, 0, "q", "index"))
        goto no_index;
    if (take(out_obj, &out, 1, "q", "out"))
        goto no_out;
    Py_ssize_t n = index.len / 8, rows = starts.len / 8;
    if (out.len / 8 != n || lengths.len / 8 != rows) {
        PyErr_SetString(PyExc_ValueError, "stamps: out must hold one stamp per index, lengths one per start");
        goto done;
    }
    const int64_t *at = starts.buf, *len = lengths.buf, *chosen = index.buf;
    for (Py_ssize_t k = 0; k < n; k++) { /* checked before the GIL goes: an error can be raised */
        int64_t i = chosen[k];
        if (i < 0 || i >= rows || !inside(at[i], len[i], buf.len)) {
            PyErr_Format(PyExc_IndexError, "stamps: index %lld is not a path of the table", (long long)chosen[k]);
            goto done;
        }
    }
    char *path = NULL;
    size_t room = 0;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n && !failed; k++) {
        /* each read once, and checked again: another thread may write the arrays while the GIL is let go */
        int64_t i = chosen[k];
        if (i < 0 || i >= rows) {
            failed = 2;
            break;
        }
        int64_t a = at[i], l = len[i];
        if (!inside(a, l, buf.len)) {
            failed = 2;
            break;
        }
        if ((size_t)l + 1 > room) {
            room = (size_t)l + 256;
            char *more = realloc(path, room);
            if (more == NULL) {
                failed = 1;
                break;
            }
            path = more;
        }
        memcpy(path, (const char *)buf.buf + a, (size_t)l);
        path[l] = 0;
        /* a path with a NUL in it names no file: its stamp is a gone file's */
        ((int64_t *)out.buf)[k] = memchr(path, 0, (size_t)l) ? 0 : stamp(path);
    }
    Py_END_ALLOW_THREADS
    free(path);
    if (failed == 1)
        PyErr_NoMemory();
    else if (failed == 2)
        PyErr_SetString(PyExc_RuntimeError, "stamps: the table's arrays changed during the call");
    else
        result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&out);
no_out:
    PyBuffer_Release(&index);
no_index:
    PyBuffer_Release(&lengths);
no_lengths:
    PyBuffer_Release(&starts);
no_starts:
    PyBuffer_Release(&buf);
    return result;
}

static PyMethodDef methods[] = {
    {"stamps", stamps, METH_VARARGS,
     "stamps(buffer, starts, lengths, index, out): the stamps of the paths buffer[starts[i]:starts[i] + lengths[i]] "
     "for each i of index (int64 arrays), written into out (int64, one per index), stat-ed without the GIL. A stamp "
     "is dali_files.stamp_key()'s number; 0 for a file that cannot be stat-ed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_stamps",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__stamps(void) { return PyModule_Create(&module); }
