"""Inputs and outputs of a compiled model without copies: what ``run()`` and ``bind()`` share.

``CompiledModel`` (tvmfuse.compile) and ``Runner`` (tvmfuse.load of an exported artifact) both take this
class's ``run`` / ``bind``; each provides ``inputs``, ``outputs``, ``device``, ``element_aligned_args`` and
``_main()``.

On a CPU target an input array goes to the kernels as it is (a DLPack view, no copy) when it is
C-contiguous, writeable and its data is aligned as the kernels assume (``arg_alignment``); otherwise it is
copied once into a tensor TVM allocates (64-byte aligned), and ``Binding.copied`` says why.  Outputs come
back as numpy arrays that view the tensors the VM allocated for this call (no copy); each call gets new
ones, so an earlier result is never overwritten.

Which alignment: by default (``PipelineOptions.element_aligned_args``) tvmfuse compiles CPU kernels that
assume their tensor arguments aligned to the element size only (4 bytes for float32), as every numpy array
is (numpy's allocator gives 16 bytes; a view such as ``a[1:]`` keeps the element alignment): ordinary numpy
inputs are read in place.  Without it (``element_aligned_args=False``, or an artifact exported before the
option existed) the kernels keep TVM's assumption of 64 bytes (``ALIGNMENT``): TVM binds every buffer
argument with ``storage_alignment = data_alignment`` (64, kAllocAlignment; MakePackedAPI's ArgBinder) and
its LLVM code generator gives each vector load and store ``align 64``, so LLVM may emit aligned moves
(vmovaps) that crash (SIGSEGV, no check in the generated code) on a pointer 4, 16 or 32 bytes past a
64-byte boundary; such a model copies every input not made with ``tvmfuse.empty``.

Copies that remain: an input that is not C-contiguous, is read-only (DLPack cannot mark it so), is not
aligned as above (e.g. a float32 view starting at an odd byte), or goes to a GPU.
"""
from __future__ import annotations

import numpy as np

from . import _compat as C
from .errors import InputError, TvmfuseError

# Bytes: the alignment TVM's generated CPU kernels assume of every tensor argument unless compiled with
# ``element_aligned_args`` (see the docstring); ``tvmfuse.empty`` allocates on it.
ALIGNMENT = 64


def empty(shape, dtype="float32") -> np.ndarray:
    """An uninitialised C-contiguous numpy array whose data starts on a 64-byte boundary: given as an
    input to ``run()``/``bind()`` it reaches the kernels without a copy."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def zeros(shape, dtype="float32") -> np.ndarray:
    """``empty`` filled with zeros."""
    a = empty(shape, dtype)
    a.fill(0)
    return a


def arg_alignment(dtype, element_aligned: bool) -> int:
    """Bytes: the alignment a CPU kernel assumes of a tensor argument of ``dtype``: the element size when
    compiled with ``element_aligned_args``, else TVM's ``ALIGNMENT``."""
    return np.dtype(dtype).itemsize if element_aligned else ALIGNMENT


def is_aligned(array: np.ndarray, alignment: int = ALIGNMENT) -> bool:
    return array.ctypes.data % alignment == 0


def no_copy_reason(array: np.ndarray, alignment: int = ALIGNMENT) -> str | None:
    """Why ``array`` cannot be given to kernels that assume ``alignment``-byte aligned arguments as it is
    (None: it can)."""
    if not array.flags.c_contiguous:
        return "not C-contiguous"
    if not array.flags.writeable:
        return "read-only (DLPack cannot signal it)"
    if array.size and not is_aligned(array, alignment):
        return (f"data not {alignment}-byte aligned (address % {alignment} = "
                f"{array.ctypes.data % alignment})")
    return None


def _check(spec, dtype: str, shape: tuple, what: str) -> None:
    if dtype != spec.dtype:
        raise InputError(f"{what} {spec.name!r} has dtype {dtype}, the model expects {spec.dtype}")
    if len(shape) != len(spec.shape) or any(isinstance(d, int) and d != s for d, s in zip(spec.shape, shape)):
        raise InputError(f"{what} {spec.name!r} has shape {list(shape)}, the model expects {list(spec.shape)}")


def _is_tensor(x) -> bool:
    return isinstance(x, C.Tensor)


def _same_device(a, b) -> bool:
    return str(a) == str(b)


def validate_feeds(feeds: dict, inputs: list) -> list:
    """Feeds in parameter order (numpy arrays or TVM tensors, not converted), or an InputError naming the
    input and what is wrong with it."""
    if not isinstance(feeds, dict):
        raise InputError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
    names = [i.name for i in inputs]
    unknown = sorted(set(feeds) - set(names))
    if unknown:
        raise InputError(f"unknown input name(s) {unknown}; the model's inputs are {names}")
    missing = [n for n in names if n not in feeds]
    if missing:
        raise InputError(f"missing input(s) {missing}; the model's inputs are {names}")
    values = []
    for spec in inputs:
        v = feeds[spec.name]
        if _is_tensor(v):
            _check(spec, str(v.dtype), tuple(v.shape), "input")
        else:
            v = np.asarray(v)
            _check(spec, str(v.dtype), v.shape, "input")
        values.append(v)
    _check_symbolic_dims(values, inputs)
    return values


def _check_symbolic_dims(values: list, inputs: list) -> None:
    """Inputs that share a symbolic dim (``sequence``) must agree on its size; an InputError names it."""
    seen: dict[str, tuple[int, str, int]] = {}
    for spec, v in zip(inputs, values):
        for axis, (d, n) in enumerate(zip(spec.shape, tuple(v.shape))):
            if not isinstance(d, str) or not d.isidentifier():   # an expression (n + 1) is the VM's to check
                continue
            if d in seen and seen[d][0] != n:
                size, other, other_axis = seen[d]
                raise InputError(f"symbolic dim {d!r} is {size} in input {other!r} (axis {other_axis}) but {n} in "
                                 f"input {spec.name!r} (axis {axis}); inputs that share it must agree")
            seen.setdefault(d, (int(n), spec.name, axis))


class Binding:
    """Inputs placed on the model's device once, for many runs (onnxruntime's IOBinding): made by
    ``model.bind(feeds)``.  ``inputs`` are the device tensors (on a CPU target, views of the given arrays
    when they allow it, see ``copied``); ``update(feeds)`` writes new values into them in place;
    ``run(outputs=None)`` runs the model on them."""

    def __init__(self, model, feeds: dict):
        self._model = model
        values = validate_feeds(feeds, model.inputs)
        self.copied: dict[str, str] = {}
        tensors = []
        for spec, v in zip(model.inputs, values):
            t, why = model._to_device(v)
            tensors.append(t)
            if why:
                self.copied[spec.name] = why
        self.inputs: dict = {s.name: t for s, t in zip(model.inputs, tensors)}
        self._args = tensors

    def update(self, feeds: dict) -> None:
        """Copy new values into bound inputs (same shape and dtype), e.g. the next batch."""
        specs = {s.name: s for s in self._model.inputs}
        for name, v in feeds.items():
            if name not in specs:
                raise InputError(f"unknown input name {name!r}; the model's inputs are {list(specs)}")
            a = np.asarray(v) if not _is_tensor(v) else v
            _check(specs[name], str(a.dtype), tuple(a.shape), "input")
            dst = self.inputs[name]
            if _is_tensor(a):
                a.copyto(dst)
            elif not (name not in self.copied and a.ctypes.data == dst.data_ptr()):   # else: already there
                dst.copyfrom(np.ascontiguousarray(a))

    def run(self, outputs: dict | None = None) -> dict[str, np.ndarray]:
        self._model._validate_outputs(outputs)
        return self._model._finish(self._model._main()(*self._args), outputs, self._args)


class Executes:
    """``run`` and ``bind`` of a compiled model or a loaded artifact (needs ``inputs``, ``outputs``,
    ``device``, ``element_aligned_args`` and ``_main()``)."""

    inputs: list
    outputs: list
    device: object
    # True: the CPU kernels assume element-size alignment of their arguments (see the module docstring)
    element_aligned_args: bool = False

    def _main(self):
        raise NotImplementedError

    def _on_cpu(self) -> bool:
        return str(self.device).startswith("cpu")

    def _to_device(self, value):
        """(tensor on the model's device, why it was copied or None)."""
        if _is_tensor(value):
            if not _same_device(value.device, self.device):
                raise InputError(f"a tensor on {value.device} was given; the model runs on {self.device}")
            if not value.is_contiguous():
                return C.tensor(value.numpy(), self.device), "tensor not contiguous"
            return value, None
        if not self._on_cpu():
            return C.tensor(np.array(value, order="C", copy=True), self.device), "host to device"
        why = no_copy_reason(value, arg_alignment(value.dtype, self.element_aligned_args))
        if why is None:
            return C.from_dlpack(value), None
        return C.tensor(np.array(value, order="C", copy=True), self.device), why

    def _output_count_error(self, got: int) -> Exception:
        return TvmfuseError(f"the model returned {got} outputs, it declares {len(self.outputs)}")

    def _validate_outputs(self, outputs: dict | None) -> None:
        """Preallocated outputs: known names, arrays or tensors of the output's shape and dtype, writeable."""
        if not outputs:
            return
        specs = {s.name: s for s in self.outputs}
        unknown = sorted(set(outputs) - set(specs))
        if unknown:
            raise InputError(f"unknown output name(s) {unknown}; the model's outputs are {list(specs)}")
        for name, dst in outputs.items():
            if _is_tensor(dst):
                _check(specs[name], str(dst.dtype), tuple(dst.shape), "output")
                continue
            if not isinstance(dst, np.ndarray):
                raise InputError(f"output {name!r}: give a numpy array or a TVM tensor, not {type(dst).__name__}")
            _check(specs[name], str(dst.dtype), dst.shape, "output")
            if not dst.flags.writeable:
                raise InputError(f"output {name!r}: the array given is read-only")

    def _finish(self, result, outputs: dict | None, args: list) -> dict[str, np.ndarray]:
        """The VM's result as {output name: numpy array}: views of the result tensors on a CPU, written
        into ``outputs[name]`` where given."""
        flat = _flatten(result)
        tensors = [t for t, _ in flat]
        if len(tensors) != len(self.outputs):
            raise self._output_count_error(len(tensors))
        given = outputs or {}
        on_cpu = self._on_cpu()
        taken = [a.data_ptr() for a in args]
        out = {}
        for spec, (t, holders) in zip(self.outputs, flat):
            if spec.name in given:
                out[spec.name] = _write_into(given[spec.name], t, spec)
                continue
            if not on_cpu:
                out[spec.name] = t.numpy()
                continue
            # A view only of a tensor nobody else holds: not of the caller's input (Identity returns it),
            # another output's memory, or one of the VM's constants (a constant output: writing into the
            # view would change the model).  A fresh result is held by our wrapper, each tuple it sits in
            # and, for the top-level value, the VM (it keeps its last return value until the next call);
            # a constant also by the executable's constant pool and the VM's registers.
            shared = t.data_ptr() in taken or C.strong_ref_count(t) > 2 + holders
            view = np.from_dlpack(t)
            if shared and view.size:
                view = view.copy()
            taken.append(t.data_ptr())
            out[spec.name] = view
        return out

    def run(self, feeds: dict, outputs: dict | None = None) -> dict[str, np.ndarray]:
        """Run on ``feeds`` ({input name: numpy array or TVM tensor}); returns {output name: numpy array}.

        No copies on a CPU target: an input that is C-contiguous, writeable and aligned as the kernels
        assume (any ordinary numpy array, see the module docstring) is read in place (others are copied
        once); outputs view the result tensors of this call.  ``outputs`` ({name: array or TVM tensor of
        the output's shape and dtype}) receives those results instead (one copy each).
        """
        values = validate_feeds(feeds, self.inputs)
        self._validate_outputs(outputs)
        args = [self._to_device(v)[0] for v in values]
        return self._finish(self._main()(*args), outputs, args)

    def bind(self, feeds: dict) -> Binding:
        """Place ``feeds`` on the device once for many ``Binding.run()`` calls (see ``Binding``)."""
        return Binding(self, feeds)


def _flatten(value, depth: int = 0) -> list:
    """[(tensor, how many of the result's tuples hold it)] in output order."""
    if _is_tensor(value):
        return [(value, depth)]
    out = []
    for v in value:
        out.extend(_flatten(v, depth + 1))
    return out


def _write_into(dst, t, spec):
    """Copy result tensor ``t`` into the preallocated ``dst`` (checked by ``_validate_outputs``)."""
    if _is_tensor(dst):
        t.copyto(dst)
    elif str(t.device).startswith("cpu"):
        np.copyto(dst, np.from_dlpack(t))
    else:
        np.copyto(dst, t.numpy())
    return dst
