//! The caller's buffers as the schedule's primitives see them: raw parts, so that the
//! primitives of one step can borrow disjoint regions at the same time. This is the
//! executor's one `unsafe` place; a validated schedule is what makes it sound.

use eccl_algorithms::{Buf, Region};

use crate::error::{Error, Result};

/// The caller's buffers as raw parts, so that the primitives of one step can borrow
/// disjoint regions of them at the same time.
pub(crate) struct Bufs {
    input: *const u8,
    input_len: usize,
    output: *mut u8,
    output_len: usize,
    scratch: *mut u8,
    scratch_len: usize,
    elem: usize,
}

// SAFETY: a `Bufs` is made from borrows that outlive it (`Bufs::new` takes them and
// `run` drops the `Bufs` before they end) and hands out slices only under the rules of
// `get`/`get_mut`; the pointers are to plain bytes that any thread may read or write.
unsafe impl Send for Bufs {}
// SAFETY: as for Send; concurrent primitives of one step touch disjoint regions.
unsafe impl Sync for Bufs {}

impl Bufs {
    pub fn new(input: &[u8], output: &mut [u8], scratch: &mut [u8], elem: usize) -> Bufs {
        Bufs {
            input: input.as_ptr(),
            input_len: input.len(),
            output: output.as_mut_ptr(),
            output_len: output.len(),
            scratch: scratch.as_mut_ptr(),
            scratch_len: scratch.len(),
            elem,
        }
    }

    fn span(&self, r: &Region) -> Result<(*mut u8, usize)> {
        let (base, len) = match r.buf {
            Buf::Input => (self.input as *mut u8, self.input_len),
            Buf::Output => (self.output, self.output_len),
            Buf::Scratch => (self.scratch, self.scratch_len),
        };
        let start = r.offset.checked_mul(self.elem);
        let bytes = r.len.checked_mul(self.elem);
        match (start, bytes) {
            (Some(s), Some(b)) if s.checked_add(b).is_some_and(|e| e <= len) => {
                Ok((base.wrapping_add(s), b))
            }
            _ => Err(Error::InvalidArgument(format!(
                "schedule region {r:?} is outside its buffer of {len} bytes"
            ))),
        }
    }

    /// # Safety
    /// No live mutable slice may overlap `r` (the schedule was validated: within a step
    /// no primitive reads what another writes).
    pub unsafe fn get(&self, r: &Region) -> Result<&[u8]> {
        let (p, n) = self.span(r)?;
        Ok(if n == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(p, n)
        })
    }

    /// # Safety
    /// `r` must not overlap any other live slice, and must not be in the input.
    // `&self` hands out `&mut`: the buffers are raw parts, and the validated schedule is
    // what keeps the regions of one step disjoint (see the Safety notes).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn get_mut(&self, r: &Region) -> Result<&mut [u8]> {
        if r.buf == Buf::Input {
            return Err(Error::InvalidArgument(
                "a schedule may not write its input".into(),
            ));
        }
        let (p, n) = self.span(r)?;
        Ok(if n == 0 {
            &mut []
        } else {
            std::slice::from_raw_parts_mut(p, n)
        })
    }
}
