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

/// The buffers of a quantized all_reduce, kept between calls (about 1.75 times the
/// largest call's values as f32, per communicator).
#[derive(Default)]
pub(crate) struct Scratch {
    values: Vec<f32>,
    send: Vec<u8>,
    recv: Vec<u8>,
    sum: Vec<f32>,
    mine: Vec<u8>,
    all: Vec<u8>,
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
        // The buffers of the last call, reused: fresh ones cost a page fault a page (a
        // quarter of a 16 MiB call on four ranks). Taken out for the call (the
        // collectives below borrow the communicator); a call that fails drops them.
        let mut s = std::mem::take(&mut self.quant_scratch);
        // Every rank owns one segment; the last is padded with the buffer's last value,
        // which leaves its block's range (and so its step) as it was; what the padding
        // sums to is dropped.
        let seg = count.div_ceil(n).max(1);
        s.values.clear();
        quant::widen(dtype, buf, &mut s.values);
        s.values
            .resize(seg * n, s.values.last().copied().unwrap_or(0.0));
        let e = quant::encoded_len(seg);
        s.send.resize(e * n, 0);
        for (v, out) in s.values.chunks(seg).zip(s.send.chunks_mut(e)) {
            quant::encode(codec, v, out);
        }
        s.recv.resize(e * n, 0);
        self.all_to_all_into(&s.send, &mut s.recv).await?;
        // This rank's segment: every rank's part of it, added in rank order.
        s.sum.clear();
        s.sum.resize(seg, 0.0);
        for part in s.recv.chunks(e) {
            quant::decode_add(codec, part, &mut s.sum);
        }
        if op == ReduceOp::Avg {
            let k = n as f32;
            s.sum.iter_mut().for_each(|x| *x /= k);
        }
        s.mine.resize(e, 0);
        quant::encode(codec, &s.sum, &mut s.mine);
        s.all.resize(e * n, 0);
        let info = self.all_gather_into(&s.mine, &mut s.all).await?;
        for (part, out) in s.all.chunks(e).zip(s.values.chunks_mut(seg)) {
            quant::decode(codec, part, out);
        }
        quant::narrow(dtype, &s.values[..count], buf);
        self.quant_scratch = s;
        Ok(info)
    }
}
