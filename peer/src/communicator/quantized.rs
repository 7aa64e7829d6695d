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
/// largest call's values as f32, per communicator). `send` and `all` are doubled: one
/// piece's codec works in one while the other piece's collective uses the other.
#[derive(Default)]
pub(crate) struct Scratch {
    values: Vec<f32>,
    send: [Vec<u8>; 2],
    recv: Vec<u8>,
    sum: Vec<f32>,
    mine: Vec<u8>,
    all: [Vec<u8>; 2],
}

/// Values of each rank's segment that one round of the pipeline moves (whole blocks):
/// large enough that a piece's two collectives are not bound by their latency (pieces
/// of 256K values made int8 over the lab's 1 Gbit/s ring 2-3 % slower at 16 and 64 MiB:
/// four times the collectives, each waiting for the slowest rank), small enough that
/// the codec of one piece hides behind the wire time of the next.
pub const QUANT_PIECE_VALUES: usize = 64 * quant::BLOCK * 64;

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
        // The segments go in pieces of whole blocks (so each block is encoded exactly
        // as in one pass: the same bytes, the same bits), and the codec of one piece
        // runs while the collective of another is on the wire: the all_to_all of piece
        // p beside the encoding of piece p+1, the all_gather of piece p beside the
        // decoding of piece p-1. A collective's sends are in the kernel and its frames
        // are read by the links' own tasks while this task codes.
        let piece = QUANT_PIECE_VALUES.min(seg.div_ceil(quant::BLOCK) * quant::BLOCK);
        let pieces = seg.div_ceil(piece);
        let range = |p: usize| (p * piece)..((p + 1) * piece).min(seg);
        let emax = quant::encoded_len(piece);
        for b in s.send.iter_mut().chain(s.all.iter_mut()) {
            b.resize(emax * n, 0);
        }
        s.recv.resize(emax * n, 0);
        s.sum.resize(piece, 0.0);
        s.mine.resize(emax, 0);
        let Scratch {
            values,
            send,
            recv,
            sum,
            mine,
            all,
        } = &mut s;
        // Bytes of each rank's part of piece p on the wire.
        let enc_len = |p: usize| quant::encoded_len(range(p).len());
        let encode_piece = |values: &[f32], p: usize, out: &mut [u8]| {
            let r = range(p);
            for (k, o) in out.chunks_mut(enc_len(p)).take(n).enumerate() {
                quant::encode(codec, &values[k * seg + r.start..k * seg + r.end], o);
            }
        };
        let decode_piece = |values: &mut [f32], p: usize, enc: &[u8]| {
            let r = range(p);
            for (k, part) in enc.chunks(enc_len(p)).take(n).enumerate() {
                quant::decode(codec, part, &mut values[k * seg + r.start..k * seg + r.end]);
            }
        };
        encode_piece(values, 0, &mut send[0]);
        let mut info = None;
        for p in 0..pieces {
            let e = enc_len(p);
            let [s0, s1] = &mut *send;
            let (cur, next) = if p % 2 == 0 { (&*s0, s1) } else { (&*s1, s0) };
            let values_ro: &[f32] = values.as_slice();
            let (r, ()) = futures::join!(
                self.all_to_all_into(&cur[..e * n], &mut recv[..e * n]),
                async {
                    if p + 1 < pieces {
                        encode_piece(values_ro, p + 1, next);
                    }
                }
            );
            r?;
            // This rank's part of piece p: every rank's values of it, added in rank order.
            let acc = &mut sum[..range(p).len()];
            acc.fill(0.0);
            for part in recv[..e * n].chunks(e) {
                quant::decode_add(codec, part, acc);
            }
            if op == ReduceOp::Avg {
                let k = n as f32;
                acc.iter_mut().for_each(|x| *x /= k);
            }
            quant::encode(codec, acc, &mut mine[..e]);
            let [a0, a1] = &mut *all;
            let (cur, prev) = if p % 2 == 0 { (a0, &*a1) } else { (a1, &*a0) };
            let values_rw: &mut [f32] = values.as_mut_slice();
            let (r, ()) =
                futures::join!(self.all_gather_into(&mine[..e], &mut cur[..e * n]), async {
                    if p > 0 {
                        decode_piece(values_rw, p - 1, prev);
                    }
                });
            info = Some(r?);
        }
        decode_piece(values, pieces - 1, &all[(pieces - 1) % 2]);
        let info = info.expect("at least one piece");
        quant::narrow(dtype, &s.values[..count], buf);
        self.quant_scratch = s;
        Ok(info)
    }
}
