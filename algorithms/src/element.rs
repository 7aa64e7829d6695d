//! Rust element types that map onto a wire [`DType`].
//!
//! Lets a typed API (`&[f32]`, `&mut [bf16]`) pick the descriptor's dtype at compile time
//! and view its buffers as bytes without a copy; `Pod` is what makes that view sound.

use eccl_protocol::DType;

/// An element type a collective can carry.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The wire dtype whose elements have exactly this layout.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl Element for $t {
            const DTYPE: DType = DType::$d;
        })*
    };
}

element! {
    f32 => F32,
    f64 => F64,
    half::f16 => F16,
    half::bf16 => BF16,
    i8 => I8,
    u8 => U8,
    i32 => I32,
    i64 => I64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size_matches<T: Element>() {
        assert_eq!(std::mem::size_of::<T>(), T::DTYPE.size(), "{}", T::DTYPE);
    }

    #[test]
    fn every_element_has_its_dtype_size() {
        size_matches::<f32>();
        size_matches::<f64>();
        size_matches::<half::f16>();
        size_matches::<half::bf16>();
        size_matches::<i8>();
        size_matches::<u8>();
        size_matches::<i32>();
        size_matches::<i64>();
    }
}
