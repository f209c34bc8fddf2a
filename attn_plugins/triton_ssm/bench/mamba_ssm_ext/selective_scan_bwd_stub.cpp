// attn-core's own file (not mamba_ssm's): the backward of mamba_ssm's selective scan, stubbed.
//
// mamba_ssm's selective_scan.cpp (packed into .ext/mamba_ssm_src/ by
// scripts/pack_mamba_ssm_src.sh) binds both "fwd" and "bwd"; its bwd dispatches
// selective_scan_bwd_cuda<input_t, weight_t> over input_t in {at::Half, at::BFloat16, float} and
// weight_t in {float, c10::complex<float>}, which mamba_ssm defines in six
// selective_scan_bwd_*.cu files that take minutes each to compile. The benchmark needs only the
// forward, so these six explicit instantiations (the same symbols as upstream's) raise instead,
// and the extension links with the forward kernels alone.
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/complex.h>
#include <cuda_runtime_api.h>  // cudaStream_t

#include "selective_scan.h"

template <typename input_t, typename weight_t>
void selective_scan_bwd_cuda(SSMParamsBwd &params, cudaStream_t stream) {
    (void)params;
    (void)stream;
    TORCH_CHECK(false,
                "selective_scan backward not built: attn-core's mamba_ssm_scan builds the "
                "forward kernels only (attn_plugins/triton_ssm/bench/mamba_ssm_scan.py)");
}

// One line per combination selective_scan.cpp's selective_scan_bwd dispatches
// (DISPATCH_ITYPE_FLOAT_AND_HALF_AND_BF16 x DISPATCH_WTYPE_FLOAT_AND_COMPLEX).
template void selective_scan_bwd_cuda<float, float>(SSMParamsBwd &params, cudaStream_t stream);
template void selective_scan_bwd_cuda<float, c10::complex<float>>(SSMParamsBwd &params, cudaStream_t stream);
template void selective_scan_bwd_cuda<at::Half, float>(SSMParamsBwd &params, cudaStream_t stream);
template void selective_scan_bwd_cuda<at::Half, c10::complex<float>>(SSMParamsBwd &params, cudaStream_t stream);
template void selective_scan_bwd_cuda<at::BFloat16, float>(SSMParamsBwd &params, cudaStream_t stream);
template void selective_scan_bwd_cuda<at::BFloat16, c10::complex<float>>(SSMParamsBwd &params, cudaStream_t stream);
