//! The engine's 16-bit activation formats (`ActFormat`: BF16, or FP16 for
//! a block whose description says so, `AttentionSpec::activations` and
//! `MlpSpec::activations`) in one place: the scratch and KV buffers are
//! allocated 2-byte (`CudaSlice<bf16>`) whatever a block stores in them,
//! so both formats have the same memory plan; a block's code sees them in
//! its format through [`view`]/[`view_mut`]. Weights carry their format
//! ([`crate::weights::Weight16`]), and a block checks it against the
//! description before it reads them.

use crate::blas::{InType, OutType};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use half::bf16;
use krasis_kernels::Act16;
use krasis_model::arch::ActFormat;

/// `s`'s storage seen as `A` (identity for bf16). Sound for both formats:
/// `Act16` is only bf16 and f16, 2-byte plain-old-data types for which every
/// bit pattern is a value, and the view covers exactly `s`'s elements.
pub(crate) fn view<A: Act16>(s: &CudaSlice<bf16>) -> CudaView<'_, A> {
    // SAFETY: see above.
    unsafe { s.transmute::<A>(s.len()) }.expect("a 2-byte view of a 2-byte buffer fits")
}

/// [`view`], writable.
pub(crate) fn view_mut<A: Act16>(s: &mut CudaSlice<bf16>) -> CudaViewMut<'_, A> {
    let n = s.len();
    // SAFETY: as in `view`.
    unsafe { s.transmute_mut::<A>(n) }.expect("a 2-byte view of a 2-byte buffer fits")
}

/// The description's format that `A` is.
pub(crate) fn format_of<A: Act16>() -> ActFormat {
    if A::F16 {
        ActFormat::F16
    } else {
        ActFormat::Bf16
    }
}

/// cuBLAS's input type for `A`.
pub(crate) fn in_type<A: Act16>() -> InType {
    if A::F16 { InType::F16 } else { InType::Bf16 }
}

/// cuBLAS's 16-bit output type for `A` (rounded once from the f32
/// accumulation).
pub(crate) fn out16<A: Act16>() -> OutType {
    if A::F16 { OutType::F16 } else { OutType::Bf16 }
}
