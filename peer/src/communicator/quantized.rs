//! All_reduce with 8-bit values on the wire ([`Quantize`]): for links where bytes cost
//! more than arithmetic (DiLoCo's outer step across sites). The scheme and its error bound
//! are `eccl_algorithms::quant`'s: each segment of a rank's buffer goes to the segment's
//! owner as 8-bit codes with a minimum and a step per block of 256 (all_to_all), the owner
//! adds them up in f32 in rank order (its own segment's values as they are) and encodes
//! the sum once, and every rank decodes every sum from the same bytes (all_gather): the same bits on every rank (G3), a quarter of an f32 ring
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

/// The buffers of a quantized all_reduce, kept between calls (per communicator: a
/// quarter of the largest f32 call's bytes for every piece's gathered codes, three
/// pieces' codes for `send` and `recv` and one piece's sum in f32; beside them `wide` and
/// `values`, which only calls on f16 and bf16, or on f32 not aligned for it, use).
/// `send` is doubled: one piece is encoded into one while the other piece's all_to_all
/// sends from the other.
#[derive(Default)]
pub(crate) struct Scratch {
    /// The buffer widened to f32 (f16, bf16, unaligned f32).
    wide: Vec<f32>,
    /// The decoded result where it cannot go straight into the caller's buffer (not
    /// f32, or not aligned for it), narrowed into it.
    values: Vec<f32>,
    send: [Vec<u8>; 2],
    recv: Vec<u8>,
    sum: Vec<f32>,
    mine: Vec<u8>,
    /// Every piece's gathered codes, decoded once the last collective succeeded.
    all: Vec<u8>,
    /// A segment's piece padded past the buffer's end (the last segments).
    tail: Vec<f32>,
}

/// `src[lo..hi]`, padded with `src`'s last value (0 if empty) where `hi` runs past its
/// end: padding that leaves the last block's range (and so its step) as it was.
fn padded<'a>(src: &'a [f32], lo: usize, hi: usize, tail: &'a mut Vec<f32>) -> &'a [f32] {
    if hi <= src.len() {
        return &src[lo..hi];
    }
    tail.clear();
    tail.extend_from_slice(&src[lo.min(src.len())..]);
    tail.resize(hi - lo, src.last().copied().unwrap_or(0.0));
    tail
}

/// Decodes `enc` (`n` ranks' codes of `values` values each, one after the other) into
/// `out[k * seg + start..][..values]` for each rank `k`, clipped to `out`'s length.
#[allow(clippy::too_many_arguments)]
fn decode_segments(
    codec: quant::Codec,
    enc: &[u8],
    n: usize,
    seg: usize,
    start: usize,
    values: usize,
    out: &mut [f32],
    tail: &mut Vec<f32>,
) {
    let e = quant::encoded_len(values);
    for (k, part) in enc.chunks(e).take(n).enumerate() {
        let (lo, hi) = (k * seg + start, k * seg + start + values);
        if hi <= out.len() {
            quant::decode(codec, part, &mut out[lo..hi]);
        } else if lo < out.len() {
            tail.clear();
            tail.resize(values, 0.0);
            quant::decode(codec, part, tail);
            let end = out.len();
            out[lo..].copy_from_slice(&tail[..end - lo]);
        }
    }
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
    /// encoding error for each other rank's value (a segment's owner adds its own values
    /// as they are) and one for the sum's: `Int8`, half a step
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
        let Some(me) = self.rank().filter(|_| n > 0) else {
            return Err(Error::InvalidArgument(
                "no world yet: call update_topology() first".into(),
            ));
        };
        // This rank's segment: the block all_to_all keeps here (blocks go by rank).
        let me = me.0 as usize;
        let count = buf.len() / dtype.size();
        // The buffers of the last call, reused: fresh ones cost a page fault a page (a
        // quarter of a 16 MiB call on four ranks). Taken out for the call (the
        // collectives below borrow the communicator); a call that fails drops them.
        let mut s = std::mem::take(&mut self.quant_scratch);
        let Scratch {
            wide,
            values,
            send,
            recv,
            sum,
            mine,
            all,
            tail,
        } = &mut s;
        // Every rank owns one segment; the last is padded with the buffer's last value
        // (`padded`), and what the padding sums to is dropped. f32 aligned for it is read
        // where it is and the result decoded into it (two copies of the buffer fewer than
        // widening and narrowing: a tenth of the call on a 1 Gbit/s ring of four); other
        // buffers are widened to f32 first.
        let seg = count.div_ceil(n).max(1);
        let direct = dtype == DType::F32 && bytemuck::try_cast_slice::<u8, f32>(buf).is_ok();
        // The segments go in pieces of whole blocks (so each block is encoded exactly
        // as in one pass: the same bytes, the same bits), and the codec of one piece
        // runs while the collective of another is on the wire: the all_to_all of piece
        // p beside the encoding of piece p+1. A collective's sends are in the kernel and
        // its frames are read by the links' own tasks while this task codes. Every
        // piece's gathered codes are kept (a quarter of the buffer's bytes) and decoded
        // into the buffer once every collective succeeded (G2): decoding pieces beside
        // the all_gathers into scratch and copying them in at the end cost more (a copy
        // of three quarters of a 64 MiB buffer per rank, on cores the calls share).
        let piece = QUANT_PIECE_VALUES.min(seg.div_ceil(quant::BLOCK) * quant::BLOCK);
        let pieces = seg.div_ceil(piece);
        let range = |p: usize| (p * piece)..((p + 1) * piece).min(seg);
        let emax = quant::encoded_len(piece);
        for b in send.iter_mut() {
            b.resize(emax * n, 0);
        }
        recv.resize(emax * n, 0);
        all.resize(emax * n * pieces, 0);
        sum.resize(piece, 0.0);
        mine.resize(emax, 0);
        // Where a widened buffer is decoded: kept at its largest size, since its
        // contents are always written before they are read.
        let decoded = if direct { 0 } else { seg * n };
        if values.len() < decoded {
            values.resize(decoded, 0.0);
        }
        let src: &[f32] = if direct {
            bytemuck::cast_slice(&*buf)
        } else {
            wide.clear();
            quant::widen(dtype, buf, wide);
            wide
        };
        // Bytes of each rank's part of piece p on the wire.
        let enc_len = |p: usize| quant::encoded_len(range(p).len());
        // Rank k's values of piece p go to rank k as codes; this rank's own part stays
        // here (its owner adds its values as they are), so its slot is not written.
        let encode_piece = |p: usize, out: &mut [u8], tail: &mut Vec<f32>| {
            let r = range(p);
            for (k, o) in out.chunks_mut(enc_len(p)).take(n).enumerate() {
                if k != me {
                    let v = padded(src, k * seg + r.start, k * seg + r.end, tail);
                    quant::encode(codec, v, o);
                }
            }
        };
        encode_piece(0, &mut send[0], tail);
        let mut info = None;
        for p in 0..pieces {
            let e = enc_len(p);
            let [s0, s1] = &mut *send;
            let (cur, next) = if p % 2 == 0 { (&*s0, s1) } else { (&*s1, s0) };
            let (r, ()) = futures::join!(
                self.all_to_all_into(&cur[..e * n], &mut recv[..e * n]),
                async {
                    if p + 1 < pieces {
                        encode_piece(p + 1, next, tail);
                    }
                }
            );
            r?;
            // This rank's part of piece p: every rank's values of it added in rank
            // order (block by block, each block of the sum in the cache meanwhile).
            let rp = range(p);
            let acc = &mut sum[..rp.len()];
            let own = padded(src, me * seg + rp.start, me * seg + rp.end, tail);
            let parts: Vec<quant::Part<'_>> = (0..n)
                .map(|k| {
                    if k == me {
                        quant::Part::Values(own)
                    } else {
                        quant::Part::Encoded(&recv[k * e..(k + 1) * e])
                    }
                })
                .collect();
            quant::sum_parts(codec, &parts, acc);
            if op == ReduceOp::Avg {
                let k = n as f32;
                acc.iter_mut().for_each(|x| *x /= k);
            }
            quant::encode(codec, acc, &mut mine[..e]);
            let cur = &mut all[p * emax * n..][..e * n];
            info = Some(self.all_gather_into(&mine[..e], cur).await?);
        }
        let info = info.expect("at least one piece");
        // Both collectives of every piece succeeded: the buffer may be written now.
        let out: &mut [f32] = if direct {
            bytemuck::cast_slice_mut(buf)
        } else {
            &mut values[..seg * n]
        };
        for p in 0..pieces {
            let r = range(p);
            let codes = &all[p * emax * n..][..enc_len(p) * n];
            decode_segments(codec, codes, n, seg, r.start, r.len(), out, tail);
        }
        if !direct {
            quant::narrow(dtype, &values[..count], buf);
        }
        self.quant_scratch = s;
        Ok(info)
    }
}
