//! Point-to-point on device memory: a send from one rank's buffer into another rank's
//! through page-locked host memory, as a pipeline of chunks.
//!
//! A send is eager, as a host send is: it returns once its bytes are handed to the link,
//! whether or not the receiver has posted its receive, so patterns that work with host
//! tensors (a ring of sends, each followed by a receive) work with device memory too.
//! The two ranks talk over a [`PairLink`] (eccl's authenticated link between them, one
//! tag, messages in order):
//!
//! 1. The sender waits for its device's queued work, then sends a header: the bytes
//!    and dtype it sends and the size of its chunks. A sender whose device fails there
//!    sends a header that says so and nothing else: the receiver fails at once, naming
//!    it, instead of waiting for chunks that never come.
//! 2. It copies its buffer to the host chunk by chunk (the next chunk's copy queued
//!    while the last one is sent) and sends each chunk.
//! 3. The receiver checks the header against its own call: another size or dtype fails
//!    the receive with a `Mismatch` naming both (the sender's chunks are received and
//!    dropped, so the next message between the two is the next call's). Otherwise it
//!    receives each chunk into a host buffer and queues its copy to the device while
//!    the next one arrives, and returns once every copy is done.
//!
//! Not over CUDA IPC: a receiver that reads the sender's buffer in place would hold the
//! sender until it has read it (a ring of sends would wait for each other for good),
//! and an eager send through a lent copy needs an acknowledgement that does not share
//! the pair's messages.
//!
//! A peer that dies or leaves fails the waiting side through the link (an aborted
//! epoch); after a failed receive the receiver's buffer is undefined, the sender's is
//! never written.

use crate::device::{DevPtr, Device};

use super::{IpcComm, IpcError};
use eccl_protocol::DType;

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// The messages of one point-to-point call between this rank and one other.
pub trait PairLink {
    /// The other rank (for errors).
    fn peer(&self) -> usize;
    /// Sends `bytes` to the other rank (returns once they are handed to the link).
    fn send(&mut self, bytes: &[u8]) -> Result<(), BoxErr>;
    /// Receives exactly `out.len()` bytes from the other rank.
    fn recv(&mut self, out: &mut [u8]) -> Result<(), BoxErr>;
}

const MAGIC: &[u8; 4] = b"ECP2";
const VERSION: u8 = 2;
/// Magic, version, status (0, or [`SENDER_FAILED`]), dtype, bytes, chunk bytes.
pub const HEADER_BYTES: usize = 4 + 1 + 1 + 1 + 8 + 8;
/// The header's status when the sender's device failed before the send (no chunks follow).
const SENDER_FAILED: u8 = 1;
/// The largest chunk a receiver accepts (what it allocates page-locked memory for).
const MAX_CHUNK: usize = 256 << 20;

fn link_error(e: BoxErr) -> IpcError {
    IpcError::Exchange(e)
}

/// The chunks of a staged transfer of `bytes`: `(offset, len)`.
fn chunks(bytes: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..bytes.div_ceil(chunk)).map(move |k| (k * chunk, chunk.min(bytes - k * chunk)))
}

impl<D: Device> IpcComm<D> {
    /// Sends `bytes` of `dtype` at `buf` (device memory of this rank's device) to the
    /// rank at the other end of `link`, whose [`IpcComm::recv_from`] takes them (see the
    /// module's steps). Returns once every chunk is handed to the link.
    ///
    /// # Safety
    /// `buf` is `bytes` of device memory on this rank's device, unchanged and not freed
    /// until the call returns.
    pub unsafe fn send_to(
        &mut self,
        link: &mut dyn PairLink,
        buf: DevPtr,
        bytes: usize,
        dtype: DType,
    ) -> Result<(), IpcError> {
        // The caller's writes to the buffer are done before it is read.
        let ready = self.dev.synchronize();
        let chunk = self.stage_bytes;
        let mut header = Vec::with_capacity(HEADER_BYTES);
        header.extend_from_slice(MAGIC);
        header.push(VERSION);
        header.push(if ready.is_ok() { 0 } else { SENDER_FAILED });
        header.push(dtype as u8);
        header.extend_from_slice(&(bytes as u64).to_le_bytes());
        header.extend_from_slice(&(chunk as u64).to_le_bytes());
        link.send(&header).map_err(link_error)?;
        ready?;
        if bytes == 0 {
            return Ok(());
        }
        let bufs = self.stage_buffers(2, chunk.min(bytes))?.to_vec();
        let plan: Vec<_> = chunks(bytes, chunk).collect();
        let sent = self.send_chunks(link, buf, &bufs, &plan);
        self.landed_if_failed(sent)
    }

    /// `outcome`, once the copies a failed transfer left queued have run: a download
    /// into a stage buffer that the next call writes from the host, or an upload into
    /// the caller's buffer that it may reuse as soon as the call returns. A transfer that
    /// succeeded waited for each of its copies already.
    fn landed_if_failed(&self, outcome: Result<(), IpcError>) -> Result<(), IpcError> {
        if outcome.is_err() {
            let _ = self.dev.synchronize();
        }
        outcome
    }

    /// The chunks of [`IpcComm::send_to`], downloaded into `bufs` in turn and sent.
    unsafe fn send_chunks(
        &mut self,
        link: &mut dyn PairLink,
        buf: DevPtr,
        bufs: &[*mut u8],
        plan: &[(usize, usize)],
    ) -> Result<(), IpcError> {
        let mut marks = Vec::with_capacity(plan.len());
        let (off, len) = plan[0];
        // SAFETY: `bufs[0]` is page-locked memory of at least `len` bytes that nothing
        // else uses; `buf + off` lies in the caller's buffer.
        marks.push(unsafe { self.dev.download_queued(bufs[0], buf + off as u64, len)? });
        for (k, &(_, len)) in plan.iter().enumerate() {
            if let Some(&(off, next_len)) = plan.get(k + 1) {
                // The other buffer's last chunk (k - 1) was sent: it is free again.
                // SAFETY: as above, for the other buffer.
                marks.push(unsafe {
                    self.dev
                        .download_queued(bufs[(k + 1) % 2], buf + off as u64, next_len)?
                });
            }
            self.dev.wait_copy(marks[k])?;
            // SAFETY: the copy into it is done (waited for above) and no other is queued
            // into this buffer until the send returns.
            let part = unsafe { std::slice::from_raw_parts(bufs[k % 2], len) };
            link.send(part).map_err(link_error)?;
        }
        Ok(())
    }

    /// Receives into `buf` (`bytes` of `dtype`, device memory of this rank's device) what
    /// the rank at the other end of `link` sends with [`IpcComm::send_to`]. A send of
    /// another size or dtype fails the receive with [`IpcError::Mismatch`].
    ///
    /// # Safety
    /// `buf` is `bytes` of device memory on this rank's device, not used by anything else
    /// until the call returns.
    pub unsafe fn recv_from(
        &mut self,
        link: &mut dyn PairLink,
        buf: DevPtr,
        bytes: usize,
        dtype: DType,
    ) -> Result<(), IpcError> {
        let peer = link.peer();
        let mut h = [0u8; HEADER_BYTES];
        link.recv(&mut h).map_err(link_error)?;
        if &h[..4] != MAGIC || h[4] != VERSION {
            return Err(IpcError::Mismatch(format!(
                "rank {peer} sent something other than a device send (a CPU tensor, or \
                 another build of eccl)"
            )));
        }
        if h[5] == SENDER_FAILED {
            return Err(IpcError::Peer {
                rank: peer,
                msg: "before the send, nothing sent (that rank's own error says how)".into(),
            });
        }
        let their_dtype = DType::from_u8(h[6]);
        let theirs = u64::from_le_bytes(h[7..15].try_into().expect("8 bytes")) as usize;
        let chunk = u64::from_le_bytes(h[15..23].try_into().expect("8 bytes")) as usize;
        if theirs > 0 && !(1..=MAX_CHUNK).contains(&chunk) {
            return Err(IpcError::Invalid(format!(
                "rank {peer}'s device send has chunks of {chunk} bytes"
            )));
        }
        let plan: Vec<_> = chunks(theirs, chunk.max(1)).collect();
        let bufs = if theirs > 0 {
            self.stage_buffers(2, chunk.min(theirs))?.to_vec()
        } else {
            Vec::new()
        };
        if theirs != bytes || their_dtype != Some(dtype) {
            // The sender's chunks are on their way: taken and dropped, so that the next
            // message between the two ranks is the next call's.
            for &(_, len) in &plan {
                // SAFETY: page-locked memory of at least `len` bytes, no copy queued.
                let part = unsafe { std::slice::from_raw_parts_mut(bufs[0], len) };
                link.recv(part).map_err(link_error)?;
            }
            let sent = match their_dtype {
                Some(d) => format!("{} elements of {}", theirs / d.size(), d.long_name()),
                None => "an unknown dtype".to_string(),
            };
            return Err(IpcError::Mismatch(format!(
                "rank {peer} sent {theirs} bytes ({sent}), this rank receives {bytes} bytes \
                 ({} elements of {})",
                bytes / dtype.size(),
                dtype.long_name()
            )));
        }
        let got = self.recv_chunks(link, buf, &bufs, &plan);
        self.landed_if_failed(got)
    }

    /// The chunks of [`IpcComm::recv_from`], received into `bufs` in turn and uploaded.
    unsafe fn recv_chunks(
        &mut self,
        link: &mut dyn PairLink,
        buf: DevPtr,
        bufs: &[*mut u8],
        plan: &[(usize, usize)],
    ) -> Result<(), IpcError> {
        let mut marks: [Option<crate::CopyMark>; 2] = [None, None];
        for (k, &(off, len)) in plan.iter().enumerate() {
            let slot = k % 2;
            // The copy out of this buffer two chunks ago must be done before it is
            // written again.
            if let Some(m) = marks[slot].take() {
                self.dev.wait_copy(m)?;
            }
            // SAFETY: page-locked memory of at least `len` bytes with no copy queued.
            let part = unsafe { std::slice::from_raw_parts_mut(bufs[slot], len) };
            link.recv(part).map_err(link_error)?;
            // SAFETY: `buf + off` lies in the caller's buffer; the host bytes stay
            // unchanged until the mark is waited for.
            marks[slot] =
                Some(unsafe { self.dev.upload_queued(buf + off as u64, bufs[slot], len)? });
        }
        for m in marks.into_iter().flatten() {
            self.dev.wait_copy(m)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::chunks;

    #[test]
    fn chunks_cover_the_bytes_in_order() {
        assert_eq!(chunks(0, 4).count(), 0);
        assert_eq!(chunks(10, 4).collect::<Vec<_>>(), [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunks(8, 4).collect::<Vec<_>>(), [(0, 4), (4, 4)]);
    }
}
