//! The accumulation type of the CPU kernels and the conversions between candle's CPU storage and
//! plain vectors. f64 stays f64; f32, bf16 and f16 are widened to f32 and rounded once on output.
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result};
use half::{bf16, f16};

pub trait Real:
    Copy
    + Send
    + Sync
    + Default
    + PartialOrd
    + std::fmt::Debug
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn powf(self, e: Self) -> Self;
    fn max(self, o: Self) -> Self;

    /// Reads a contiguous region of `storage` described by `layout` as a vector of `Self`.
    fn read(storage: &CpuStorage, layout: &Layout) -> Result<Vec<Self>> {
        let (start, end) = match layout.contiguous_offsets() {
            Some(o) => o,
            None => bail!("vime-kernels: input must be contiguous (layout {layout:?})"),
        };
        Ok(match storage {
            CpuStorage::F64(v) => v[start..end].iter().map(|&x| Self::from_f64(x)).collect(),
            CpuStorage::F32(v) => v[start..end].iter().map(|&x| Self::from_f64(x as f64)).collect(),
            CpuStorage::BF16(v) => v[start..end].iter().map(|&x| Self::from_f64(x.to_f64())).collect(),
            CpuStorage::F16(v) => v[start..end].iter().map(|&x| Self::from_f64(x.to_f64())).collect(),
            other => bail!("vime-kernels: unsupported dtype {:?}", other.dtype()),
        })
    }

    /// Writes `v` as a storage of `dtype` (rounding once for bf16/f16).
    fn write(v: Vec<Self>, dtype: DType) -> Result<CpuStorage> {
        Ok(match dtype {
            DType::F64 => CpuStorage::F64(v.into_iter().map(|x| x.to_f64()).collect()),
            DType::F32 => CpuStorage::F32(v.into_iter().map(|x| x.to_f64() as f32).collect()),
            DType::BF16 => CpuStorage::BF16(v.into_iter().map(|x| bf16::from_f64(x.to_f64())).collect()),
            DType::F16 => CpuStorage::F16(v.into_iter().map(|x| f16::from_f64(x.to_f64())).collect()),
            other => bail!("vime-kernels: unsupported output dtype {other:?}"),
        })
    }
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            #[inline]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
            #[inline]
            fn cos(self) -> Self {
                <$t>::cos(self)
            }
            #[inline]
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
            #[inline]
            fn max(self, o: Self) -> Self {
                <$t>::max(self, o)
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

/// Runs `$body` with `$R` bound to the accumulation type for `$dtype`: f64 for f64, f32 otherwise.
#[macro_export]
macro_rules! with_acc {
    ($dtype:expr, $R:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F64 => {
                type $R = f64;
                $body
            }
            candle_core::DType::F32 | candle_core::DType::BF16 | candle_core::DType::F16 => {
                type $R = f32;
                $body
            }
            other => candle_core::bail!("vime-kernels: unsupported dtype {other:?}"),
        }
    };
}

/// Checks that all float inputs of one op share a dtype, naming the op in the error.
pub fn same_dtype(op: &str, dtypes: &[DType]) -> Result<DType> {
    let d = dtypes[0];
    if dtypes.iter().any(|&x| x != d) {
        bail!("{op}: inputs must share a dtype, got {dtypes:?}");
    }
    Ok(d)
}
