/* tvmfuse's native run() step (issue 11): the VM call and its result handed back as a numpy array, in C.
 *
 * Built at first use by tvmfuse/runtime_native.py (a C compiler, Python's, numpy's and tvm-ffi's headers);
 * without it run() takes the same steps in Python (tvmfuse/io.py).  One function:
 *
 *   call_one(func_handle, arg_handle, input_data, name, typenum) -> {name: ndarray} | None
 *
 * func_handle: the VM function's tvm-ffi handle (``main.__chandle__()``); arg_handle: the input tensor's
 * handle; input_data: its data pointer (call_many: one of each per input, at most MAX_INPUTS); name: the output's name; typenum: the numpy type number the output
 * must have.  Calls the function with the GIL released (as tvm-ffi's own call does), then:
 *  - a CPU tensor of that dtype, compact, held only by this result and the VM's last-result register
 *    (strong count <= 2) and not the input's memory: a numpy array viewing its data; the array's base
 *    (a capsule) holds the tensor until the array is dropped (the VM's pool gets the buffer back then);
 *  - the same but shared (a VM constant, an input itself): a numpy copy (writing into the result must not
 *    change the model or the input);
 *  - anything else (an error raised by the call, another kind of result): None, with the error cleared and
 *    the result released; the caller then makes the same call through tvm-ffi's Python path, which raises
 *    the error as tvm-ffi does or hands the result to the general output handling.
 *
 * And numpy's allocator of 64-byte aligned array data (NEP 49, tvmfuse.io.aligned_numpy):
 *
 *   set_aligned_handler(on, hugepage) -> the previous handler (a capsule)
 *
 * on: install the aligned handler in the calling context (numpy's handler is a context variable), else
 * numpy's default; hugepage: advise huge pages on data of at least HUGEPAGE_MIN_BYTES, as numpy's own
 * allocator does (np._core.multiarray._get_madvise_hugepage()).  Every block is ALIGN_PAD bytes more than
 * asked: the data starts at the first ALIGN_BYTES boundary after a pointer-sized header that holds what
 * malloc returned (free and realloc need it).  calloc stays calloc (pages the kernel zeroes lazily).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif
#include <tvm/ffi/c_api.h>

static const char* kCapsuleName = "tvmfuse.tensor";

static void release_tensor(PyObject* capsule) {
  void* handle = PyCapsule_GetPointer(capsule, kCapsuleName);
  if (handle != NULL) TVMFFIObjectDecRef(handle);
}

/* numpy's type number of a DLPack dtype with one lane, or -1 */
static int dl_typenum(DLDataType t) {
  if (t.lanes != 1) return -1;
  switch (t.code) {
    case kDLFloat:
      return t.bits == 16 ? NPY_FLOAT16 : t.bits == 32 ? NPY_FLOAT32 : t.bits == 64 ? NPY_FLOAT64 : -1;
    case kDLInt:
      return t.bits == 8 ? NPY_INT8 : t.bits == 16 ? NPY_INT16 : t.bits == 32 ? NPY_INT32
             : t.bits == 64 ? NPY_INT64 : -1;
    case kDLUInt:
      return t.bits == 8 ? NPY_UINT8 : t.bits == 16 ? NPY_UINT16 : t.bits == 32 ? NPY_UINT32
             : t.bits == 64 ? NPY_UINT64 : -1;
    case kDLBool:
      return t.bits == 8 ? NPY_BOOL : -1;
    default:
      return -1;
  }
}

#define MAX_INPUTS 64

/* The VM call's result as {name: ndarray} (see the header), or None; consumes ``out``'s reference. */
static PyObject* result_dict(TVMFFIAny out, void* const* input_data, Py_ssize_t n_inputs, PyObject* name,
                             long typenum) {
  if (out.type_index != kTVMFFITensor) {
    if (out.type_index >= kTVMFFIStaticObjectBegin && out.v_obj != NULL) TVMFFIObjectDecRef(out.v_obj);
    Py_RETURN_NONE;
  }
  TVMFFIObject* obj = out.v_obj;
  DLTensor* t = (DLTensor*)((char*)obj + sizeof(TVMFFIObject));
  npy_intp dims[NPY_MAXDIMS];
  int compact = t->ndim <= NPY_MAXDIMS;
  if (compact) {
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
      dims[i] = (npy_intp)t->shape[i];
      if (t->strides != NULL && t->shape[i] != 1 && t->strides[i] != expect) compact = 0;
      expect *= t->shape[i];
    }
  }
  if (!compact || t->device.device_type != kDLCPU || dl_typenum(t->dtype) != typenum) {
    TVMFFIObjectDecRef(obj);
    Py_RETURN_NONE;
  }
  void* data = (char*)t->data + t->byte_offset;
  /* strong count: the low 32 bits of the header's first word (c_api.h, TVMFFIObject) */
  uint32_t strong = (uint32_t)(obj->combined_ref_count & 0xFFFFFFFFu);
  int shared = strong > 2;
  for (Py_ssize_t i = 0; i < n_inputs && !shared; ++i) shared = data == input_data[i];
  PyObject* arr;
  if (shared) {
    arr = PyArray_SimpleNew(t->ndim, dims, (int)typenum);
    if (arr != NULL) memcpy(PyArray_DATA((PyArrayObject*)arr), data, PyArray_NBYTES((PyArrayObject*)arr));
    TVMFFIObjectDecRef(obj);
    if (arr == NULL) return NULL;
  } else {
    PyObject* base = PyCapsule_New(obj, kCapsuleName, release_tensor);
    if (base == NULL) {
      TVMFFIObjectDecRef(obj);
      return NULL;
    }
    arr = PyArray_New(&PyArray_Type, t->ndim, dims, (int)typenum, NULL, data, 0, NPY_ARRAY_CARRAY, NULL);
    if (arr == NULL) {
      Py_DECREF(base);
      return NULL;
    }
    if (PyArray_SetBaseObject((PyArrayObject*)arr, base) != 0) {   /* steals base, also on failure */
      Py_DECREF(arr);
      return NULL;
    }
  }
  PyObject* result = PyDict_New();
  if (result == NULL || PyDict_SetItem(result, name, arr) != 0) {
    Py_XDECREF(result);
    Py_DECREF(arr);
    return NULL;
  }
  Py_DECREF(arr);
  return result;
}

/* Call ``func`` on ``n`` tensors with the GIL released; the result dict (result_dict) or None. */
static PyObject* call_tensors(void* func, TVMFFIAny* in, int n, void* const* input_data, PyObject* name,
                              long typenum) {
  TVMFFIAny out;
  memset(&out, 0, sizeof(out));
  out.type_index = kTVMFFINone;
  int rc;
  Py_BEGIN_ALLOW_THREADS;
  rc = TVMFFIFunctionCall(func, in, n, &out);
  Py_END_ALLOW_THREADS;
  if (rc != 0) {                     /* the caller repeats the call through tvm-ffi, which raises it */
    TVMFFIObjectHandle err = NULL;
    TVMFFIErrorMoveFromRaised(&err);
    if (err != NULL) TVMFFIObjectDecRef(err);
    Py_RETURN_NONE;
  }
  return result_dict(out, input_data, n, name, typenum);
}

static PyObject* call_one(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "call_one(func_handle, arg_handle, input_data, name, typenum)");
    return NULL;
  }
  void* func = PyLong_AsVoidPtr(args[0]);
  void* arg = PyLong_AsVoidPtr(args[1]);
  void* input_data = PyLong_AsVoidPtr(args[2]);
  long typenum = PyLong_AsLong(args[4]);
  if (PyErr_Occurred()) return NULL;
  if (func == NULL || arg == NULL) {
    PyErr_SetString(PyExc_ValueError, "call_one: a null function or tensor handle");
    return NULL;
  }
  TVMFFIAny in;
  memset(&in, 0, sizeof(in));
  in.type_index = kTVMFFITensor;
  in.v_obj = (TVMFFIObject*)arg;
  return call_tensors(func, &in, 1, &input_data, args[3], typenum);
}

static PyObject* call_many(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 5 || !PyTuple_CheckExact(args[1]) || !PyTuple_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError,
                    "call_many(func_handle, (arg_handle, ...), (input_data, ...), name, typenum)");
    return NULL;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(args[1]);
  if (n < 1 || n > MAX_INPUTS || PyTuple_GET_SIZE(args[2]) != n) {
    PyErr_Format(PyExc_ValueError, "call_many: %zd handles and %zd data pointers (1 to %d, one of each per "
                 "input)", n, PyTuple_GET_SIZE(args[2]), MAX_INPUTS);
    return NULL;
  }
  void* func = PyLong_AsVoidPtr(args[0]);
  long typenum = PyLong_AsLong(args[4]);
  TVMFFIAny in[MAX_INPUTS];
  void* input_data[MAX_INPUTS];
  memset(in, 0, sizeof(TVMFFIAny) * (size_t)n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    in[i].type_index = kTVMFFITensor;
    in[i].v_obj = (TVMFFIObject*)PyLong_AsVoidPtr(PyTuple_GET_ITEM(args[1], i));
    input_data[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args[2], i));
    if (in[i].v_obj == NULL && !PyErr_Occurred())
      PyErr_SetString(PyExc_ValueError, "call_many: a null tensor handle");
  }
  if (PyErr_Occurred()) return NULL;
  if (func == NULL) {
    PyErr_SetString(PyExc_ValueError, "call_many: a null function handle");
    return NULL;
  }
  return call_tensors(func, in, (int)n, input_data, args[3], typenum);
}


/* ---------------------------------------------------------------- numpy's aligned allocator (NEP 49) */

#define ALIGN_BYTES 64                               /* TVM's kAllocAlignment: a cache line */
#define ALIGN_PAD (ALIGN_BYTES + sizeof(void*))      /* the header and the worst-case shift to a boundary */
#define HUGEPAGE_MIN_BYTES ((size_t)1 << 22)         /* numpy's threshold for madvise(MADV_HUGEPAGE) */
#define PAGE_BYTES ((size_t)4096)

static int advise_hugepage = 1;

/* the aligned data pointer within a raw block, with the raw pointer stored just before it */
static void* place(char* raw) {
  uintptr_t p = ((uintptr_t)raw + sizeof(void*) + ALIGN_BYTES - 1) & ~(uintptr_t)(ALIGN_BYTES - 1);
  ((void**)p)[-1] = raw;
  return (void*)p;
}

static void hugepages(void* p, size_t size) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (advise_hugepage && size >= HUGEPAGE_MIN_BYTES) {
    uintptr_t start = ((uintptr_t)p + PAGE_BYTES - 1) & ~(uintptr_t)(PAGE_BYTES - 1);
    uintptr_t end = (uintptr_t)p + size;
    if (end > start) madvise((void*)start, end - start, MADV_HUGEPAGE);   /* advice only: result unused */
  }
#else
  (void)p;
  (void)size;
#endif
}

static void* aligned_malloc(void* ctx, size_t size) {
  (void)ctx;
  if (size > SIZE_MAX - ALIGN_PAD) return NULL;
  char* raw = malloc(size + ALIGN_PAD);
  if (raw == NULL) return NULL;
  void* p = place(raw);
  hugepages(p, size);
  return p;
}

static void* aligned_calloc(void* ctx, size_t nelem, size_t elsize) {
  (void)ctx;
  if (elsize != 0 && nelem > (SIZE_MAX - ALIGN_PAD) / elsize) return NULL;
  size_t size = nelem * elsize;
  char* raw = calloc(1, size + ALIGN_PAD);
  if (raw == NULL) return NULL;
  void* p = place(raw);
  hugepages(p, size);
  return p;
}

static void* aligned_realloc(void* ctx, void* ptr, size_t new_size) {
  if (ptr == NULL) return aligned_malloc(ctx, new_size);
  if (new_size > SIZE_MAX - ALIGN_PAD) return NULL;
  char* raw = ((char**)ptr)[-1];
  size_t shift = (size_t)((char*)ptr - raw);
  char* moved = realloc(raw, new_size + ALIGN_PAD);
  if (moved == NULL) return NULL;                    /* the old block is still valid, as realloc's */
  uintptr_t p = ((uintptr_t)moved + sizeof(void*) + ALIGN_BYTES - 1) & ~(uintptr_t)(ALIGN_BYTES - 1);
  /* realloc kept the bytes at moved + shift; the boundary may now lie elsewhere in the block */
  if ((char*)p != moved + shift) memmove((void*)p, moved + shift, new_size);
  ((void**)p)[-1] = moved;
  return (void*)p;
}

static void aligned_free(void* ctx, void* ptr, size_t size) {
  (void)ctx;
  (void)size;
  if (ptr != NULL) free(((void**)ptr)[-1]);
}

static PyDataMem_Handler aligned_handler = {
    "tvmfuse_aligned_64", 1, {NULL, aligned_malloc, aligned_calloc, aligned_realloc, aligned_free}};

static PyObject* set_aligned_handler(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "set_aligned_handler(on, hugepage)");
    return NULL;
  }
  int on = PyObject_IsTrue(args[0]);
  int huge = PyObject_IsTrue(args[1]);
  if (on < 0 || huge < 0) return NULL;
  advise_hugepage = huge;
  PyObject* capsule = NULL;
  if (on) {
    capsule = PyCapsule_New(&aligned_handler, "mem_handler", NULL);
    if (capsule == NULL) return NULL;
  }
  /* NULL: numpy's default handler */
  PyObject* previous = PyDataMem_SetHandler(capsule);
  Py_XDECREF(capsule);
  return previous;
}

static PyMethodDef methods[] = {
    {"call_one", (PyCFunction)(void (*)(void))call_one, METH_FASTCALL,
     "call_one(func_handle, arg_handle, input_data, name, typenum) -> {name: ndarray} or None"},
    {"call_many", (PyCFunction)(void (*)(void))call_many, METH_FASTCALL,
     "call_many(func_handle, (arg_handle, ...), (input_data, ...), name, typenum) -> {name: ndarray} or None"},
    {"set_aligned_handler", (PyCFunction)(void (*)(void))set_aligned_handler, METH_FASTCALL,
     "set_aligned_handler(on, hugepage) -> the previous numpy allocator (a capsule)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tvmfuse_native_io", NULL, -1, methods,
                                          NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tvmfuse_native_io(void) {
  import_array();
  return PyModule_Create(&module);
}
