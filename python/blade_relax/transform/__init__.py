"""Passes: each a ``tvm.transform.Pass`` whose ``name`` equals its class name, and whose
``last_result`` says what its last run changed (:class:`PassResult`)."""

from ._warn import PassFallbackWarning, warn_fallback
from .bind_elementwise_kernels import BindElementwiseKernels, BindElementwiseOptions
from .check_dim_ranges import CheckDimRanges, DimRangeOptions
from .clone_generated_tensors import CloneGeneratedTensors, CloneOptions
from .dispatch import version_for
from .dispatch_gemm import DispatchGemm, GemmOptions
from .expand_math import ExpandMathIntrinsics, MathOptions
from .fold_broadcast_matmul import BroadcastMatmulOptions, FoldBroadcastMatmul
from .fold_zero_scatter import FoldZeroScatter, ZeroScatterOptions
from .fuse_attention import AttentionOptions, FuseAttention
from .fuse_into_sole_reader import FuseIntoSoleReader, FuseReaderOptions
from .inline_kernel_intermediates import InlineKernelIntermediates, InlineOptions
from .mark_gemm_kernels import MarkGemmKernels
from .plan import PlanMemory, PlanOptions
from .recompute_cheap_values import RecomputeCheapValues, RecomputeOptions
from .remat import Rematerialize, RematOptions, RematTimeline
from .result import FunctionResult, PassResult, collect_results
from .rewrite_softmax_backward import (
    RewriteSoftmaxBackward,
    SoftmaxBackwardOptions,
    SoftmaxBackwardReport,
)
from .schedule import CompileClock, MemoryAwareSchedule, ScheduleOptions
from .simplify_transposes import SimplifyTransposes, TransposeOptions
from .specialize_buckets import SpecializeBuckets
from .vectorize_column_reductions import ColumnReductionOptions, VectorizeColumnReductions
from .vectorize_score_grad import ScoreGradOptions, VectorizeScoreGrad
from .vectorize_softmax import SoftmaxOptions, VectorizeSoftmax

__all__ = [
    "AttentionOptions",
    "BroadcastMatmulOptions",
    "CheckDimRanges",
    "CloneGeneratedTensors",
    "CloneOptions",
    "ColumnReductionOptions",
    "CompileClock",
    "DimRangeOptions",
    "DispatchGemm",
    "ExpandMathIntrinsics",
    "FoldBroadcastMatmul",
    "FoldZeroScatter",
    "FunctionResult",
    "FuseAttention",
    "FuseIntoSoleReader",
    "FuseReaderOptions",
    "GemmOptions",
    "InlineKernelIntermediates",
    "InlineOptions",
    "BindElementwiseKernels",
    "BindElementwiseOptions",
    "MarkGemmKernels",
    "MathOptions",
    "MemoryAwareSchedule",
    "PassFallbackWarning",
    "PassResult",
    "PlanMemory",
    "PlanOptions",
    "RecomputeCheapValues",
    "RecomputeOptions",
    "RematOptions",
    "RematTimeline",
    "Rematerialize",
    "RewriteSoftmaxBackward",
    "ScheduleOptions",
    "ScoreGradOptions",
    "SoftmaxBackwardOptions",
    "SoftmaxBackwardReport",
    "SimplifyTransposes",
    "SoftmaxOptions",
    "SpecializeBuckets",
    "TransposeOptions",
    "VectorizeColumnReductions",
    "VectorizeScoreGrad",
    "VectorizeSoftmax",
    "ZeroScatterOptions",
    "collect_results",
    "version_for",
    "warn_fallback",
]
