"""Packed documents for the gated short convolution's tests (tests/kernels/test_short_conv.py and
tests/kernels/interpreter/short_conv_cases.py): the float64 reference's backward run on each document alone,
which a packed window with doc_start must reproduce."""

import torch

from documents import document_spans

from atma_titan.kernels.short_conv import gated_conv_backward_reference


def each_document_alone(u, do, weight, bias, doc_start):
    """(dz, o, column sums of dz, dw) of the float64 reference run on each document of the packed window as a
    sequence of its own (zero-padded): dz and o put back in place, the sums and dw summed over documents."""
    u, do, weight = u.double(), do.double(), weight.double()
    bias = None if bias is None else bias.double()
    dz, o = torch.empty_like(u), torch.empty_like(do)
    sums = torch.zeros(u.shape[-1], dtype=torch.float64)
    dw = torch.zeros_like(weight)
    for b, spans in enumerate(document_spans(doc_start)):
        for first, end in spans:
            alone = gated_conv_backward_reference(u[b : b + 1, first:end], do[b : b + 1, first:end], weight, bias)
            dz[b, first:end], o[b, first:end] = alone[0][0], alone[1][0]
            sums += alone[2]
            dw += alone[3]
    return dz, o, sums, dw
