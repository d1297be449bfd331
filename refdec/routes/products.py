"""The fast route's floating-point matrix products, each on the kernel this machine computes it fastest
with, among kernels a user of torch already has.

A decoder step's products read every weight of the decoder once: at one row they are bound by how fast
the weights stream from memory, at tens of rows by the core's multiply-adds. How close a kernel comes to
either depends on the CPU as much as on the kernel. On an AMD EPYC, the MKL that torch calls for
`torch.addmm` takes a code path that is not the fastest the core has: on one with AVX-512 (one thread,
the 6-layer model of width 256, the 37 products of one decoder step), numpy's OpenBLAS computed them in
1207 us at one row against MKL's 1508, and oneDNN's product on a packed weight in 5402 us at 64 rows
against 11263 (docs/cpu-cost.md). So a product here is one of three kernels (KERNELS):

    torch     torch.addmm on the (in, out) matrix: MKL on an x86 CPU, what the fast route always took
    onednn    torch's oneDNN linear (torch.ops.mkldnn._linear_pointwise) on the weight packed once in
              oneDNN's blocked layout (float32 only); a ReLU after it fused into the same pass
    openblas  numpy's OpenBLAS, called through its C interface on the tensors' memory (`openblas_product`):
              a matrix-vector product at one row, a matrix product for more, the bias and the residual
              summed into the output first and the product added to them in the same call; on as many
              threads as torch for the call (numpy's own count is put back after it)

Which kernel computes a product is decided per model shape (d_model, d_ff, vocabulary), dtype, thread
count and class of row counts (probes.ROW_CLASSES), by refdec.routes.probes.float_plan: from the machine
report a process is given (REFDEC_MACHINE_REPORT; `refdec machine --report` times the kernels on a step's
products of the model's shape and records the fastest), else by a rule on the CPU's vendor and
instructions that never times anything. The
kernels sum in different orders, so a float32 product's last bits depend on the kernel: a choice made by a
fresh timing could make two runs of one command round differently, and none is. Where a kernel is not
there (no numpy OpenBLAS, no oneDNN, another dtype) or the call is traced by torch.compile, or not on a
CPU, the product is torch's. The reference route never comes here: it is model.py's F.linear.
"""

from __future__ import annotations

import copy
import ctypes
from pathlib import Path

import numpy  # noqa: F401  (loads numpy's OpenBLAS into the process, where OpenBLAS finds it)
import torch
import torch.nn.functional as F

from . import probes

KERNELS = probes.FLOAT_KERNEL_NAMES  # ("torch", "onednn", "openblas")
PACK_ROWS = 32  # the row count oneDNN's packed layout is made for (it computes any count)
BLAS_NAMES = (  # OpenBLAS's C interface as numpy's builds name it: (call name format, integer type, thread calls)
    ("scipy_cblas_{}64_", ctypes.c_int64, "scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
    ("cblas_{}64_", ctypes.c_int64, "openblas_get_num_threads64_", "openblas_set_num_threads64_"),
    ("cblas_{}", ctypes.c_int, "openblas_get_num_threads", "openblas_set_num_threads"),
)
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # the C interface's constants


# -- numpy's OpenBLAS -------------------------------------------------------------------------------------
class OpenBLAS:
    """numpy's OpenBLAS library, found among the process's loaded libraries (Linux): its thread-count getter
    and setter, and per dtype its matrix product (`gemm`) and matrix-vector product (`gemv`) through the C
    interface, called on torch tensors' memory. Each found library is checked on a small product whose
    result is exact before it is taken; `setter` is None where none is found or passes (the kernel is not
    there)."""

    def __init__(self):
        self.getter = self.setter = None
        self.gemm: dict = {}  # dtype -> the library's ?gemm
        self.gemv: dict = {}
        try:
            maps = Path("/proc/self/maps").read_text().splitlines()
        except OSError:
            return
        libraries = sorted({line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1].lower()})
        for path in libraries:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for name, integer, get, put in BLAS_NAMES:
                calls = [name.format(c) for c in ("sgemm", "sgemv", "dgemm", "dgemv")]
                if all(hasattr(lib, n) for n in (get, put, *calls)):
                    self.bind(lib, name, integer, get, put)
                    if self.works():
                        return
        self.getter = self.setter = None

    def bind(self, lib, name: str, integer, get: str, put: str) -> None:
        self.getter, self.setter = getattr(lib, get), getattr(lib, put)
        self.getter.argtypes, self.getter.restype = [], ctypes.c_int
        self.setter.argtypes, self.setter.restype = [ctypes.c_int], None
        pointer, enum = ctypes.c_void_p, ctypes.c_int
        for dtype, letter, scalar in ((torch.float32, "s", ctypes.c_float), (torch.float64, "d", ctypes.c_double)):
            gemm, gemv = getattr(lib, name.format(letter + "gemm")), getattr(lib, name.format(letter + "gemv"))
            # order, trans a, trans b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc
            gemm.argtypes = (
                [enum] * 3 + [integer] * 3 + [scalar, pointer, integer, pointer, integer, scalar, pointer, integer]
            )
            # order, trans, m, n, alpha, a, lda, x, incx, beta, y, incy
            gemv.argtypes = (
                [enum] * 2 + [integer] * 2 + [scalar, pointer, integer, pointer, integer, scalar, pointer, integer]
            )
            gemm.restype = gemv.restype = None
            self.gemm[dtype], self.gemv[dtype] = gemm, gemv

    def works(self) -> bool:
        """Whether the calls bound compute a small product exactly (integers), at one row and at three."""
        with torch.inference_mode(False), torch.no_grad():
            for dtype in (torch.float32, torch.float64):
                w = torch.arange(12, dtype=dtype).view(3, 4)
                for rows in (1, 3):
                    x = torch.arange(3 * rows, dtype=dtype).view(rows, 3) - 2
                    y = torch.ones(rows, 4, dtype=dtype)
                    blas_product(self, x, w, y, 1.0)
                    if not torch.equal(y, x @ w + 1):
                        return False
        return True


_openblas: list[OpenBLAS] = []  # found at the first need


def openblas() -> OpenBLAS:
    if not _openblas:
        _openblas.append(OpenBLAS())
    return _openblas[0]


def blas_product(lib: OpenBLAS, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, beta: float) -> None:
    """y (N, out) = x (N, in) @ w (in, out) + beta * y, in place, by the library on the tensors' memory (each
    contiguous): at one row a matrix-vector product, which streams the weight fastest there, else a matrix
    product."""
    (N, K), M = x.shape, w.shape[1]
    if N == 1:  # y = w.T @ x: the row-major (in, out) matrix transposed
        lib.gemv[x.dtype](ROW_MAJOR, TRANS, K, M, 1.0, w.data_ptr(), M, x.data_ptr(), 1, beta, y.data_ptr(), 1)
    elif N > 1:  # (a call of no rows computes nothing)
        a, b, c = x.data_ptr(), w.data_ptr(), y.data_ptr()
        lib.gemm[x.dtype](ROW_MAJOR, NO_TRANS, NO_TRANS, N, M, K, 1.0, a, K, b, M, beta, c, M)


def openblas_product(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, add: torch.Tensor | None, threads: int
) -> torch.Tensor:
    """x (N, in) @ w (in, out) + bias + add by numpy's OpenBLAS, on `threads` threads, as torch computes with:
    the bias and the residual are summed into the output first, and the product adds itself to them (the
    call's beta term: no pass over the output after it). The library's own thread count is put back after
    the call (refdec changes nothing process-wide: a user's numpy keeps its threads)."""
    x, w = x.contiguous(), w.contiguous()  # (themselves when they are: the fast route's are)
    if add is not None:  # a new tensor, whole: the call writes it
        y = add.clone(memory_format=torch.contiguous_format) if bias is None else torch.add(add, bias).contiguous()
    elif bias is not None:
        y = x.new_empty(x.shape[0], w.shape[1]).copy_(bias)
    else:
        y = x.new_empty(x.shape[0], w.shape[1])
    beta = 0.0 if add is None and bias is None else 1.0
    lib = openblas()
    before = lib.getter()
    if before == threads:
        blas_product(lib, x, w, y, beta)
        return y
    lib.setter(threads)
    try:
        blas_product(lib, x, w, y, beta)
    finally:
        lib.setter(before)
    return y


def available(dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels that can compute a product of this dtype here."""
    found = ["torch"]
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        found.append("onednn")
    if dtype in (torch.float32, torch.float64) and openblas().setter is not None:
        found.append("openblas")
    return tuple(found)


# -- a weight, as each kernel takes it ------------------------------------------------------------------------
class FloatWeight:
    """A linear map's weight for the float products: `in_out` (in, out), so that x @ in_out is the map (a
    contiguous copy in the fast route's layout, or a view of the parameter), which torch's and OpenBLAS's
    products read as it is; oneDNN's packed weight is made from it at its first use and kept (a copy: a
    layout made again when the parameter changes makes it again)."""

    __slots__ = ("in_out", "model", "packed", "plans", "revision")

    def __init__(self, in_out: torch.Tensor, model: tuple[int, int, int] | None = None):
        self.in_out, self.model = in_out, model  # model: (d_model, d_ff, vocabulary), whose plan it follows
        self.packed = None
        self.plans: dict = {}  # threads -> the kernel of each row class (probes.float_plan; x's dtype is in_out's)
        self.revision = probes.revision[0]  # the decisions the plans were taken from

    def __deepcopy__(self, memo: dict) -> FloatWeight:
        """A copy of the matrix; the other forms are made again at first use (oneDNN's packed tensor is opaque
        to copy.deepcopy)."""
        return FloatWeight(copy.deepcopy(self.in_out, memo), self.model)

    @property
    def shape(self) -> torch.Size:
        return self.in_out.shape

    def kernel(self, rows: int, x: torch.Tensor) -> str:
        """The kernel for a product of `rows` rows of x with this weight (the module docstring)."""
        if self.model is None or x.device.type != "cpu" or x.dtype != self.in_out.dtype:
            return "torch"
        if torch.compiler.is_compiling():  # a traced step: torch's operations alone
            return "torch"
        if self.revision != probes.revision[0]:  # decisions dropped, read or measured since
            self.plans, self.revision = {}, probes.revision[0]
        threads = torch.get_num_threads()
        kernels = self.plans.get(threads)
        if kernels is None:
            kernels = self.plans[threads] = probes.float_plan(self.model, x.dtype, available(x.dtype)).kernels
        return kernels[0 if rows <= 1 else probes.row_class(rows)]

    def onednn_weight(self) -> torch.Tensor:
        if self.packed is None:
            with torch.inference_mode(False), torch.no_grad():
                plain = self.in_out.detach().t().contiguous()  # (out, in)
                self.packed = torch.ops.mkldnn._reorder_linear_weight(plain, PACK_ROWS)
        return self.packed


# -- the product ------------------------------------------------------------------------------------------
def product(
    x: torch.Tensor,
    w: FloatWeight,
    bias: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    relu: bool = False,
    kernel: str | None = None,
) -> torch.Tensor:
    """x (N, in) @ w + bias, through a ReLU with `relu`, plus `add` (N, out): a residual stream the product
    adds to (it is not written). On the kernel w.kernel chooses for N rows, or on `kernel`."""
    kernel = kernel or w.kernel(x.shape[0], x)
    if kernel == "onednn":
        y = torch.ops.mkldnn._linear_pointwise(x, w.onednn_weight(), bias, "relu" if relu else "none", [], "")
    elif kernel == "openblas":  # the bias and the residual in the call's beta term (the ReLU comes before a residual)
        y = openblas_product(x, w.in_out, bias, None if relu else add, torch.get_num_threads())
        if not relu:
            return y
    elif add is not None and not relu:  # torch: the residual sum done by the product itself
        y = torch.addmm(add, x, w.in_out)
        return y if bias is None else y.add_(bias)
    else:
        y = torch.mm(x, w.in_out) if bias is None else torch.addmm(bias, x, w.in_out)
    if relu and kernel != "onednn":
        y = F.relu_(y)
    return y if add is None else y.add_(add)


def on_kernel(kernel: str, x: torch.Tensor, w: FloatWeight) -> torch.Tensor:
    return product(x, w, kernel=kernel)


PROBED = probes.FloatKernels(available, FloatWeight, on_kernel)  # what refdec machine's probe times


def measure_plan(model: tuple[int, int, int], dtype: torch.dtype = torch.float32) -> probes.FloatPlan:
    """The kernels timed now on the products of a step of a model of (d_model, d_ff, vocabulary)
    (probes.measure_float_plan), kept as this process's plan."""
    return probes.measure_float_plan(model, dtype, PROBED)
