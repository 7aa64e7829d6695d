//! All_reduce with 8-bit values on the wire ([`Quantize`]): for links where bytes cost
//! more than arithmetic (DiLoCo's outer step across sites). The scheme and its error bound
//! are `eccl_algorithms::quant`'s: each rank's segment of the buffer goes to its owner as
//! 8-bit codes with a minimum and a step per block of 256 (all_to_all), the owner adds them
//! up in f32 in rank order and encodes the sum once, and every rank decodes every sum from
//! the same bytes (all_gather): the same bits on every rank (G3), a quarter of an f32 ring
//! all_reduce's bytes (half of a bf16 one's). The buffer is written only when both calls
//! succeeded: a failure leaves it as it was (G2).

use eccl_algorithms::quant;
use eccl_protocol::{DType, ReduceOp};

use super::{Communicator, OpInfo};
use crate::error::{Error, Result};
use crate::Element;

/// How an all_reduce's values travel (f32, f16, bf16; sum and avg).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantize {
    /// Min-max 8-bit integers per block of 256 values.
    Int8,
    /// FP8 E4M3 scaled per block of 256 values (each block's largest magnitude to 448).
    Fp8,
}

impl Quantize {
    /// `int8` or `fp8` (what Python's `quantize=` takes).
    pub fn parse(s: &str) -> Option<Quantize> {
        match s.trim().to_ascii_lowercase().as_str() {
            "int8" => Some(Quantize::Int8),
            "fp8" => Some(Quantize::Fp8),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Quantize::Int8 => "int8",
            Quantize::Fp8 => "fp8",
        }
    }

    fn codec(self) -> quant::Codec {
        match self {
            Quantize::Int8 => quant::Codec::Int8,
            Quantize::Fp8 => quant::Codec::Fp8,
        }
    }
}

impl Communicator {
    /// [`Communicator::all_reduce_quantized_bytes`] on a typed slice.
    pub async fn all_reduce_quantized<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        q: Quantize,
    ) -> Result<OpInfo> {
        self.all_reduce_quantized_bytes(T::DTYPE, bytemuck::cast_slice_mut(buf), op, q)
            .await
    }

    /// All_reduce in place of `buf` (elements of `dtype`: f32, f16 or bf16; `Sum` or
    /// `Avg`) with quantized values on the wire; every rank gets the same bits. The
    /// result differs from an exact all_reduce, per element, by at most the sum of one
    /// encoding error for each rank's value and one for the sum's: `Int8`, half a step
    /// of the block (its range over 255); `Fp8`, `max(|v| / 16, scale / 1024)` with
    /// `scale` the block's largest magnitude over 448. A block with a NaN or an infinity
    /// comes back NaN.
    pub async fn all_reduce_quantized_bytes(
        &mut self,
        dtype: DType,
        buf: &mut [u8],
        op: ReduceOp,
        q: Quantize,
    ) -> Result<OpInfo> {
        let codec = q.codec();
        if !quant::supported(dtype) {
            return Err(Error::InvalidArgument(format!(
                "quantize={} takes f32, f16 or bf16, not {dtype}",
                q.name()
            )));
        }
        if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
            return Err(Error::InvalidArgument(format!(
                "quantize={} sums (sum or avg), not {}",
                q.name(),
                op.name()
            )));
        }
        if !buf.len().is_multiple_of(dtype.size()) {
            return Err(Error::InvalidArgument(format!(
                "{} bytes are not whole {dtype} elements",
                buf.len()
            )));
        }
        let n = self.world_size() as usize;
        if n == 0 {
            return Err(Error::InvalidArgument(
                "no world yet: call update_topology() first".into(),
            ));
        }
        let count = buf.len() / dtype.size();
        // Every rank owns one segment; the last is padded with the buffer's last value,
        // which leaves its block's range (and so its step) as it was; what the padding
        // sums to is dropped.
        let seg = count.div_ceil(n).max(1);
        let mut values = Vec::with_capacity(seg * n);
        quant::widen(dtype, buf, &mut values);
        values.resize(seg * n, values.last().copied().unwrap_or(0.0));
        let e = quant::encoded_len(seg);
        let mut send = vec![0u8; e * n];
        for (v, s) in values.chunks(seg).zip(send.chunks_mut(e)) {
            quant::encode(codec, v, s);
        }
        let mut recv = vec![0u8; e * n];
        self.all_to_all_into(&send, &mut recv).await?;
        // This rank's segment: every rank's part of it, added in rank order.
        let mut sum = vec![0f32; seg];
        for part in recv.chunks(e) {
            quant::decode_add(codec, part, &mut sum);
        }
        if op == ReduceOp::Avg {
            let k = n as f32;
            sum.iter_mut().for_each(|s| *s /= k);
        }
        let mut mine = vec![0u8; e];
        quant::encode(codec, &sum, &mut mine);
        let mut all = vec![0u8; e * n];
        let info = self.all_gather_into(&mine, &mut all).await?;
        for (part, out) in all.chunks(e).zip(values.chunks_mut(seg)) {
            quant::decode(codec, part, out);
        }
        quant::narrow(dtype, &values[..count], buf);
        Ok(info)
    }
}
