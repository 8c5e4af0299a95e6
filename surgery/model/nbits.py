"""MatMulNBits weights (ONNX Runtime's com.microsoft op) as arrays: read, dequantize, requantize.

    Y = A @ W + bias,  W[k, n] = (code[n, k] - zero[n, k // block_size]) * scale[n, k // block_size]

B holds the codes packed into uint8, [N, blocks, block_size * bits / 8], low bits first along K; scales are
[N * blocks] (or [N, blocks]); zero points are packed the same way along the blocks ([N * ceil(blocks * bits / 8)]),
or floats of the scales' type, or absent (2^(bits - 1)). Blocks run along K, so a weight whose K is not a multiple
of block_size has padding codes past K.

A folded weight keeps the node's bits, block size, scales and zero points (so its symmetry and accuracy_level too):
only the codes are chosen again, by round-to-nearest, or error-aware (GPTQ, Frantar et al. 2022): column by column
along K, each rounding error spread over the columns not yet rounded through the inverse of the input's second
moments H = sum x x' (the calibration statistics of the projection's input), which minimises |X (W_q - W)|^2
rather than |W_q - W|^2. An unchanged weight gets back its own codes either way.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from surgery.errors import SurgeryError

OP = "MatMulNBits"
B, SCALES, ZERO_POINTS, G_IDX, BIAS = 1, 2, 3, 4, 5  # input indices
DAMPING = 0.01  # of H's mean diagonal, added to it before the error-aware requantization (GPTQ's default)
COLUMNS = 128  # GPTQ's lazy batch: columns rounded before the rest of the weight is updated


def optional(node: ir.Node, index: int) -> ir.Value | None:
    """The node's input `index`, None when it is left out (absent or empty)."""
    return node.inputs[index] if len(node.inputs) > index else None


def array(node: ir.Node, index: int) -> np.ndarray | None:
    """The constant array of the node's input `index`, None when it is left out or not a constant."""
    value = optional(node, index)
    return None if value is None or value.const_value is None else value.const_value.numpy()


def stored_scales(like: ir.Node, scales: np.ndarray) -> np.ndarray:
    """[N, blocks] scales laid out as the node `like` stores its own: flat [N * blocks] or [N, blocks]."""
    return scales.reshape(-1) if array(like, SCALES).ndim == 1 else scales


@dataclasses.dataclass(frozen=True)
class Quantized:
    """One MatMulNBits node's weight: codes [N, K_padded] (unpacked), scales and zero points [N, blocks] (float64)."""

    k: int
    n: int
    bits: int
    block_size: int
    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    blob: tuple[int, ...]  # B's shape
    dtype: np.dtype  # the scales' (and the activations') float type

    def dequantize(self) -> np.ndarray:
        """The [K, N] float64 weight the node multiplies by."""
        step = np.repeat(self.scales, self.block_size, axis=1)
        return ((self.codes - np.repeat(self.zeros, self.block_size, axis=1)) * step)[:, : self.k].T

    def packed(self, codes: np.ndarray) -> np.ndarray:
        """codes [N, K_padded] -> B, packed as the node's."""
        return pack(codes, self.bits).reshape(self.blob)

    def round(self, weight: np.ndarray) -> np.ndarray:
        """Round-to-nearest codes [N, K_padded] of a [K, N] weight on these scales and zero points (padding kept)."""
        step = np.repeat(self.scales, self.block_size, axis=1)[:, : self.k]
        zero = np.repeat(self.zeros, self.block_size, axis=1)[:, : self.k]
        codes = self.codes.copy()
        codes[:, : self.k] = _clip(np.rint(np.asarray(weight, np.float64).T / np.where(step == 0, 1, step)) + zero, self.bits)
        return codes

    def gptq(self, weight: np.ndarray, hessian: np.ndarray) -> np.ndarray:
        """Error-aware codes [N, K_padded] of a [K, N] weight: min |X (W_q - W)|^2 for inputs X with X'X = hessian
        [K, K] (see the module docstring); on these scales and zero points."""
        k = self.k
        step = np.repeat(self.scales, self.block_size, axis=1)[:, :k]  # [N, K]
        zero = np.repeat(self.zeros, self.block_size, axis=1)[:, :k]
        h = np.array(hessian, np.float64)
        dead = np.diag(h) <= 0  # inputs that never fire: any code serves, round to nearest
        h[dead, dead] = 1.0
        h[np.diag_indices(k)] += DAMPING * float(np.mean(np.diag(h)))
        try:  # the upper Cholesky factor of H^-1 (H^-1 = u' u), as GPTQ uses it
            u = np.linalg.cholesky(np.linalg.inv(h)).T
        except np.linalg.LinAlgError as e:
            raise SurgeryError(f"cannot requantize a {self.bits}-bit weight error-aware: its input statistics are singular ({e})") from None
        w = np.asarray(weight, np.float64).T.copy()  # [N, K]: column j is input feature j
        codes = self.codes.copy()
        safe = np.where(step == 0, 1, step)
        for start in range(0, k, COLUMNS):
            stop = min(start + COLUMNS, k)
            errors = np.zeros((self.n, stop - start))
            for j in range(start, stop):
                q = _clip(np.rint(w[:, j] / safe[:, j]) + zero[:, j], self.bits)
                codes[:, j] = q
                err = (w[:, j] - (q - zero[:, j]) * step[:, j]) / u[j, j]
                w[:, j:stop] -= np.outer(err, u[j, j:stop])
                errors[:, j - start] = err
            w[:, stop:] -= errors @ u[start:stop, stop:]
        return codes


def _clip(codes: np.ndarray, bits: int) -> np.ndarray:
    return np.clip(codes, 0, (1 << bits) - 1)


def unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """uint8 [..., bytes] -> codes [..., count] (float64), low bits first."""
    per = 8 // bits
    shifts = np.arange(per, dtype=np.uint8) * bits
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count].astype(np.float64)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [..., count] -> uint8 [..., ceil(count * bits / 8)], low bits first (missing codes 0)."""
    per = 8 // bits
    codes = np.asarray(codes).astype(np.uint8)
    pad = (-codes.shape[-1]) % per
    if pad:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], pad), np.uint8)], axis=-1)
    grouped = codes.reshape(*codes.shape[:-1], -1, per)
    shifts = np.arange(per, dtype=np.uint8) * bits
    return np.bitwise_or.reduce(grouped << shifts, axis=-1).astype(np.uint8)


def refusal(node: ir.Node) -> str | None:
    """Why this MatMulNBits weight cannot be read as arrays, or None."""
    attrs = {k: a.value for k, a in node.attributes.items()}
    bits = attrs.get("bits", 4)
    if bits not in (2, 4, 8):
        return f"its weights are {bits}-bit, and only 2-, 4- and 8-bit codes pack into whole bytes"
    if optional(node, G_IDX) is not None:
        return "its weights have a group index (g_idx, act-order), which a fold cannot keep"
    for index, what in ((B, "weights"), (SCALES, "scales"), (ZERO_POINTS, "zero points")):
        if optional(node, index) is not None and array(node, index) is None:
            return f"its {what} are not a constant"
    zp = array(node, ZERO_POINTS)
    if zp is not None and zp.dtype != np.uint8:
        return "its zero points are floats, not packed integers"
    return None


def read(node: ir.Node) -> Quantized:
    """The weight of a MatMulNBits node (SurgeryError, from refusal(), when it cannot be read)."""
    if (why := refusal(node)) is not None:
        raise SurgeryError(f"MatMulNBits {node.name!r}: {why}")
    attrs = {k: a.value for k, a in node.attributes.items()}
    k, n, bits, block_size = attrs["K"], attrs["N"], attrs.get("bits", 4), attrs["block_size"]
    packed, stored, zp = array(node, B), array(node, SCALES), array(node, ZERO_POINTS)
    blocks = -(-k // block_size)
    codes = unpack(packed.reshape(n, -1), bits, blocks * block_size)
    scales = stored.astype(np.float64).reshape(n, blocks)
    zeros = np.full((n, blocks), float(1 << (bits - 1))) if zp is None else unpack(zp.reshape(n, -1), bits, blocks)
    return Quantized(k, n, bits, block_size, codes, scales, zeros, tuple(packed.shape), stored.dtype)
