"""The backward of a 1-D convolution, as torch's joint export writes it.

``convolution_backward.default(grad_output, input, weight, bias_sizes, stride, padding,
dilation, transposed, output_padding, groups, output_mask)`` gives the gradients of a
convolution's input, weight and bias (those ``output_mask`` asks for). TVM's importer has no
converter for it, so a model that trains a convolution was refused: the short causal
convolutions of LFM2's ``conv`` layers (depthwise, kernel 3, padded by 2 and cut back to the
length), and every model built on them. Each gradient is a Relax operator TVM legalizes for any
symbolic length, so the memory passes see them as any other kernel:

``grad_input``
    The transposed convolution of ``grad_output`` with the same weight, stride, padding,
    dilation and groups (the weight ``[O, I / groups, K]`` read as ``conv1d_transpose``'s
    ``IOW``), its output padding chosen so that it is as long as the input. An output padding
    that depends on the length (a stride above one over a symbolic length) is refused.
``grad_weight``
    ``grad_weight[o, i, k] = sum over n, t of grad_output[n, o, t] * input[n, i', t * stride +
    k * dilation - padding]``, tap by tap (``K`` is a constant): what tap ``k`` reads of the
    input (the input padded by constants, or a strided slice of it padded), multiplied by
    ``grad_output`` and summed where the convolution is depthwise, else one batched matmul per
    group summed over the batch. (A grouped convolution with the batch as channels would do it
    in one operator, from reshapes of the input and of ``grad_output``: see below.)
``grad_bias``
    ``grad_output`` summed over the batch and the length.

Over a symbolic length the weight's gradient is built without slicing that length: on the
graphs of ``tests/frontend/test_convolution.py`` (batch 2), TVM's ``RewriteDataflowReshape``
stopped with "The padding factor ... is not divisible" on the strided slices of the padded input
that a tap would read, and on the reshapes of the grouped formulation above. So there, only a
stride of one with a padding of at least ``dilation * (kernel - 1)`` (each tap is then the input
padded by constants: causal convolutions are) and groups of one or one per channel are
converted; other settings are converted for constant lengths. Convolutions of other ranks,
transposed convolutions and the rest are refused (``NotImplementedError``, naming what was
asked); the forward ``convolution`` keeps TVM's converter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tvm
from tvm import relax

__all__ = ["CONVOLUTION_CONVERTERS"]


def _convolution_backward(node: Any, importer: Any) -> relax.Var:
    args = importer.retrieve_args(node)
    grad_output, data, weight = args[:3]
    stride, padding, dilation, transposed, _, groups, mask = args[4:11]
    if transposed or len(data.ty.shape) != 3:
        raise NotImplementedError(
            f"convolution_backward of a {len(data.ty.shape) - 2}-d"
            f"{' transposed' if transposed else ''} convolution: only 1-d convolutions are "
            "converted"
        )
    conv = _Conv1d(int(stride[0]), int(padding[0]), int(dilation[0]), int(groups))
    bb = importer.block_builder
    # A gradient torch does not ask for is never read: a scalar stands in for it.
    unused = relax.const(0, str(grad_output.ty.dtype))
    grads = [
        conv.input_grad(bb, grad_output, data, weight) if mask[0] else unused,
        conv.weight_grad(bb, grad_output, data, weight) if mask[1] else unused,
        bb.emit(relax.op.sum(grad_output, axis=[0, 2])) if mask[2] else unused,
    ]
    return bb.emit(relax.Tuple(grads))


@dataclass(frozen=True)
class _Conv1d:
    """A 1-D convolution's settings, and the gradients of its input and weight."""

    stride: int
    padding: int
    dilation: int
    groups: int

    def input_grad(
        self, bb: Any, grad_output: relax.Expr, data: relax.Expr, weight: relax.Expr
    ) -> relax.Var:
        length, out_length = data.ty.shape[2], grad_output.ty.shape[2]
        kernel = weight.ty.shape[2]
        # conv1d_transpose's length is (out - 1) * stride - 2 * padding + dilation * (K - 1)
        # + output_padding + 1; the output padding makes it the input's.
        full = (out_length - 1) * self.stride - 2 * self.padding + self.dilation * (kernel - 1) + 1
        extra = tvm.sym.Analyzer().simplify(length - full)
        if not isinstance(extra, tvm.tirx.IntImm) or not 0 <= int(extra) < self.stride:
            raise NotImplementedError(
                f"convolution_backward: the input's gradient needs an output padding of {extra}, "
                "which is not a constant below the stride"
            )
        return bb.emit(
            relax.op.nn.conv1d_transpose(
                grad_output,
                weight,
                strides=self.stride,
                padding=self.padding,
                output_padding=int(extra),
                dilation=self.dilation,
                groups=self.groups,
            )
        )

    def weight_grad(
        self, bb: Any, grad_output: relax.Expr, data: relax.Expr, weight: relax.Expr
    ) -> relax.Var:
        out_channels, in_per_group, kernel = (int(d) for d in weight.ty.shape)
        out_per_group = out_channels // self.groups
        out_length = grad_output.ty.shape[2]
        depthwise = in_per_group == out_per_group == 1
        if not isinstance(data.ty.shape[2], tvm.tirx.IntImm) and (
            not (depthwise or self.groups == 1) or not self._padded_taps(kernel)
        ):
            raise NotImplementedError(
                "convolution_backward over a symbolic length: only a stride of one, a padding "
                "of at least dilation * (kernel - 1) and groups of 1 or one per channel are "
                "converted (the weight's gradient would slice that length)"
            )
        # Taps that are slices read the input padded on both sides, made once.
        padded = data
        if not self._padded_taps(kernel) and self.padding:
            pad = [0, 0, 0, 0, self.padding, self.padding]
            padded = bb.emit(relax.op.nn.pad(data, pad))
        taps = []
        for k in range(kernel):
            tap = self._tap(bb, data, padded, k, kernel, out_length)
            if depthwise:  # one product per channel
                product = bb.emit(relax.op.multiply(grad_output, tap))
                taps.append(bb.emit(relax.op.sum(product, axis=[0, 2], keepdims=True)))
                continue
            blocks = []
            for g in range(self.groups):
                rows = _channels(bb, grad_output, g * out_per_group, out_per_group)
                cols = _channels(bb, tap, g * in_per_group, in_per_group)
                cols = bb.emit(relax.op.permute_dims(cols, [0, 2, 1]))
                product = bb.emit(relax.op.matmul(rows, cols))  # [N, O/g, I/g]
                blocks.append(bb.emit(relax.op.sum(product, axis=[0])))
            block = blocks[0] if len(blocks) == 1 else bb.emit(relax.op.concat(blocks, axis=0))
            taps.append(bb.emit(relax.op.expand_dims(block, [2])))
        if depthwise:
            # [1, C, 1] per tap: the taps side by side, then [C, 1, K].
            joined = bb.emit(relax.op.concat(taps, axis=2))
            return bb.emit(relax.op.permute_dims(joined, [1, 0, 2]))
        return bb.emit(relax.op.concat(taps, axis=2))

    def _padded_taps(self, kernel: int) -> bool:
        """Whether every tap reads the input padded by constants, with no slice (a stride of
        one and a padding of at least ``dilation * (kernel - 1)``)."""
        return self.stride == 1 and self.padding >= self.dilation * (kernel - 1)

    def _tap(
        self,
        bb: Any,
        data: relax.Expr,
        padded: relax.Expr,
        k: int,
        kernel: int,
        out_length: Any,
    ) -> relax.Expr:
        """What tap ``k`` multiplies: ``input[..., t * stride + k * dilation - padding]`` for
        ``t < out_length``, zero outside the input: the input padded by constants (see
        :meth:`_padded_taps`), else a strided slice of ``padded``, the input padded on both
        sides (for constant lengths only: see the module's docstring)."""
        if self._padded_taps(kernel):
            left = self.padding - k * self.dilation
            right = self.padding - (kernel - 1 - k) * self.dilation
            if left == right == 0:
                return data
            return bb.emit(relax.op.nn.pad(data, [0, 0, 0, 0, left, right]))
        start = k * self.dilation
        end = start + (out_length - 1) * self.stride + 1
        return bb.emit(
            relax.op.strided_slice(padded, [2], [start], [end], [self.stride], assume_inbound=True)
        )


def _channels(bb: Any, x: relax.Expr, first: int, count: int) -> relax.Expr:
    """Channels ``first`` to ``first + count`` of ``x`` (all of them when they are)."""
    if first == 0 and count == int(x.ty.shape[1]):
        return x
    return bb.emit(relax.op.strided_slice(x, [1], [first], [first + count]))


CONVOLUTION_CONVERTERS = {"convolution_backward.default": _convolution_backward}
