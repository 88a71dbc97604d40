/* A window of a JPEG decoded, and only as much of the file as the window needs.

   The train recipe's crop keeps a part of each image; libjpeg-turbo's own API (since 1.5) can decode just that part:
   jpeg_skip_scanlines() passes over the rows above it without the inverse DCT, upsampling or colour conversion,
   jpeg_crop_scanline() limits those steps to the window's columns, and decoding stops after its last row, so the rows
   below it are not even entropy-decoded. TurboJPEG 2.1's API (libturbojpeg0, what PyTurboJPEG 1.x loads) has no
   cropping region; TurboJPEG 3's tj3SetCroppingRegion() does the same as this.

   The pixels are those of the whole image's decode (TurboJPEG's defaults: the accurate integer inverse DCT, fancy
   upsampling): fancy upsampling treats the ends of a cropped scanline as the image's edges, so one more column is
   decoded on each side of the window than it needs. A warning from libjpeg (corrupt or truncated data) is an error
   here, as in the turbojpeg backend's whole decode; the data after the window's last row is not read, so what is
   wrong there (and only there) goes unnoticed. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int warning; /* whether the error was a warning made one */
    char message[JMSG_LENGTH_MAX];
} error_mgr;

static void on_error(j_common_ptr cinfo) {
    error_mgr *err = (error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) { /* a warning: corrupt or truncated data */
        ((error_mgr *)cinfo->err)->warning = 1;
        on_error(cinfo);
    }
}

typedef struct {
    int denom, top, left, height, width;
} window;

/* Decode `w` of the image reduced by 1/denom into `out` (height x width x 3 RGB). Returns 0, 1 (libjpeg's error or
   warning, in err->message and err->warning) or 2 (the window is not inside the reduced image). Runs without the
   GIL. */
static int decode(const unsigned char *data, size_t size, window w, unsigned char *out, error_mgr *err) {
    struct jpeg_decompress_struct cinfo;
    unsigned char *volatile row = NULL;
    volatile int status = 0;
    cinfo.err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    if (setjmp(err->jump)) { /* before jpeg_create_decompress, which reports a library mismatch through it */
        status = 1;
        goto done;
    }
    jpeg_create_decompress(&cinfo); /* sets cinfo.mem first: jpeg_destroy_decompress is safe whatever fails */
    jpeg_mem_src(&cinfo, data, (unsigned long)size);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)w.denom;
    jpeg_start_decompress(&cinfo);
    if ((long long)w.top + w.height > (long long)cinfo.output_height ||
        (long long)w.left + w.width > (long long)cinfo.output_width) {
        status = 2;
        goto done;
    }
    /* one column more each side (where there is one): the window's own pixels are then interior ones */
    JDIMENSION first = w.left > 0 ? (JDIMENSION)w.left - 1 : 0;
    JDIMENSION end = (JDIMENSION)(w.left + w.width) < cinfo.output_width ? (JDIMENSION)(w.left + w.width) + 1
                                                                          : cinfo.output_width;
    JDIMENSION x0 = first, cols = end - first;
    if (cols < cinfo.output_width) jpeg_crop_scanline(&cinfo, &x0, &cols); /* x0 moves left to an iMCU edge */
    if (x0 > (JDIMENSION)w.left || (size_t)x0 + cols < (size_t)w.left + (size_t)w.width) {
        snprintf(err->message, JMSG_LENGTH_MAX, "libjpeg cropped the scanline to columns %u-%u, not around the window",
                 (unsigned)x0, (unsigned)(x0 + cols));
        status = 1;
        goto done;
    }
    row = (unsigned char *)malloc((size_t)cols * 3);
    if (row == NULL) {
        snprintf(err->message, JMSG_LENGTH_MAX, "out of memory");
        status = 1;
        goto done;
    }
    if (w.top > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)w.top);
    size_t skip = ((size_t)w.left - x0) * 3, line = (size_t)w.width * 3;
    for (int y = 0; y < w.height; y++) {
        JSAMPROW rows[1] = {row};
        if (jpeg_read_scanlines(&cinfo, rows, 1) != 1) {
            snprintf(err->message, JMSG_LENGTH_MAX, "libjpeg gave no row %d", w.top + y);
            status = 1;
            goto done;
        }
        memcpy(out + (size_t)y * line, row + skip, line);
    }
done:
    free(row);
    jpeg_destroy_decompress(&cinfo); /* no jpeg_finish_decompress: the rows below the window are never decoded */
    return status;
}

static PyObject *decode_window(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data, out;
    window w;
    if (!PyArg_ParseTuple(args, "y*iiiiiw*", &data, &w.denom, &w.top, &w.left, &w.height, &w.width, &out)) return NULL;
    PyObject *result = NULL;
    if (w.denom != 1 && w.denom != 2 && w.denom != 4 && w.denom != 8) {
        PyErr_Format(PyExc_ValueError, "denom must be 1, 2, 4 or 8, not %d", w.denom);
    } else if (w.top < 0 || w.left < 0 || w.height <= 0 || w.width <= 0) {
        PyErr_Format(PyExc_ValueError, "not a window: top %d, left %d, height %d, width %d", w.top, w.left, w.height,
                     w.width);
    } else if (!PyBuffer_IsContiguous(&out, 'C') || out.len != (Py_ssize_t)w.height * w.width * 3) {
        PyErr_Format(PyExc_ValueError, "out must be a contiguous buffer of %d x %d x 3 bytes", w.height, w.width);
    } else {
        error_mgr err;
        int status;
        err.message[0] = 0;
        err.warning = 0;
        Py_BEGIN_ALLOW_THREADS;
        status = decode((const unsigned char *)data.buf, (size_t)data.len, w, (unsigned char *)out.buf, &err);
        Py_END_ALLOW_THREADS;
        if (status == 1) {
            PyErr_SetString(err.warning ? PyExc_RuntimeWarning : PyExc_OSError, err.message);
        } else if (status == 2) {
            PyErr_Format(PyExc_ValueError, "the window (top %d, left %d, %d x %d) is not inside the image reduced 1/%d",
                         w.top, w.left, w.height, w.width, w.denom);
        } else {
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

/* header(data): what a decode of `data` would read before its first scan. No libjpeg call after jpeg_read_header,
   so Python objects are only made once nothing can jump. Holds the GIL (a header is a few microseconds). */
static PyObject *header(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    PyObject *volatile result = NULL;
    err.message[0] = 0;
    err.warning = 0;
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    if (setjmp(err.jump)) {
        PyErr_SetString(err.warning ? PyExc_RuntimeWarning : PyExc_OSError, err.message);
        goto done;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
    jpeg_save_markers(&cinfo, JPEG_APP0 + 1, 0xFFFF);
    jpeg_read_header(&cinfo, TRUE);
    jpeg_saved_marker_ptr exif = cinfo.marker_list;
    while (exif != NULL && !(exif->marker == JPEG_APP0 + 1 && exif->data_length >= 6 &&
                             memcmp(exif->data, "Exif\0\0", 6) == 0))
        exif = exif->next;
    result = Py_BuildValue("(IIOny#)", (unsigned)cinfo.image_height, (unsigned)cinfo.image_width,
                           cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK ? Py_True
                                                                                                    : Py_False,
                           (Py_ssize_t)(data.len - (Py_ssize_t)cinfo.src->bytes_in_buffer),
                           exif != NULL ? (const char *)exif->data : NULL,
                           exif != NULL ? (Py_ssize_t)exif->data_length : (Py_ssize_t)0);
done:
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_window", decode_window, METH_VARARGS,
     "decode_window(data, denom, top, left, height, width, out): the window of the JPEG `data` reduced by 1/denom "
     "(1, 2, 4 or 8), decoded as RGB into `out` (a writable contiguous buffer of height x width x 3 bytes). libjpeg's "
     "message as OSError when it cannot decode, as RuntimeWarning (raised) for corrupt or truncated data."},
    {"header", header, METH_VARARGS,
     "header(data): (height, width, cmyk, end, exif) of the JPEG `data` as libjpeg reads it before a decode: cmyk "
     "when it is CMYK or YCCK, end the bytes read up to its first scan's data, exif its first APP1 Exif block "
     "(bytes, from 'Exif\\0\\0' on) or None. Errors as decode_window's."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_jpeg_window",
    .m_size = -1,
    .m_methods = methods,
};

/* Whether the libjpeg loaded is the one the module was built against (same API version and struct layout): a
   decompressor made and dropped. Else the module does not load, and the backend decodes whole images. */
static int library_matches(error_mgr *err) {
    struct jpeg_decompress_struct cinfo;
    cinfo.err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    if (setjmp(err->jump)) return 0;
    jpeg_create_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    return 1;
}

PyMODINIT_FUNC PyInit__jpeg_window(void) {
    error_mgr err;
    err.message[0] = 0;
    if (!library_matches(&err)) {
        PyErr_Format(PyExc_ImportError, "the libjpeg loaded is not the one gpupipe._jpeg_window was built against: %s",
                     err.message);
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION_NUMBER", LIBJPEG_TURBO_VERSION_NUMBER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
