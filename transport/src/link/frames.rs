//! How every transport cuts a region into frames: one plan, so that a stream link, a
//! shared-memory ring and a verbs queue pair put the same bytes at the same offsets.

use eccl_protocol::frame::FrameHeader;

/// The frames of one region: frame `i` carries `payload[i * frame ..]` (at most `frame`
/// bytes) with `header`'s `offset` and `len` set to match. An empty region is one empty
/// frame, so that every send is seen by the receiver.
#[derive(Clone, Copy, Debug)]
pub struct Frames<'a> {
    header: FrameHeader,
    payload: &'a [u8],
    frame: usize,
    count: usize,
}

impl<'a> Frames<'a> {
    /// Frames of at most `frame_bytes` bytes, a multiple of `align` (an element's size, so
    /// that no element is split), and at most `max` (what one frame of the transport can
    /// carry; at least one element).
    pub fn new(
        header: FrameHeader,
        payload: &'a [u8],
        frame_bytes: usize,
        align: usize,
        max: usize,
    ) -> Frames<'a> {
        let align = align.max(1);
        let max = max.max(align);
        let frame = (frame_bytes.clamp(align, max) / align * align).max(align);
        Frames {
            header,
            payload,
            frame,
            count: payload.len().div_ceil(frame).max(1),
        }
    }

    /// How many frames there are (at least one).
    pub fn count(&self) -> usize {
        self.count
    }

    /// Frame `i`: its header and its part of the payload.
    pub fn get(&self, i: usize) -> (FrameHeader, &'a [u8]) {
        let start = (i * self.frame).min(self.payload.len());
        let end = (start + self.frame).min(self.payload.len());
        let mut h = self.header;
        h.offset = start as u64;
        h.len = (end - start) as u32;
        (h, &self.payload[start..end])
    }

    /// Every frame in order.
    pub fn iter(&self) -> impl Iterator<Item = (FrameHeader, &'a [u8])> + '_ {
        (0..self.count).map(|i| self.get(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> FrameHeader {
        FrameHeader {
            seq: 2,
            index: 3,
            ..crate::link::test_util::data_header(0)
        }
    }

    /// Every byte lands once, at its offset, in frames of whole elements within the
    /// transport's bound; an empty region is one empty frame.
    #[test]
    fn frames_cover_the_region_in_whole_elements() {
        let payload: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        for (len, frame_bytes, align, max) in [
            (0, 64, 4, 1 << 20),
            (1000, 64, 4, 1 << 20),
            (1000, 63, 4, 1 << 20),
            (1000, 1 << 20, 8, 96),
            (1000, 0, 2, 1 << 20),
            (1000, 64, 16, 10),
            (999, 100, 1, 100),
        ] {
            let f = Frames::new(header(), &payload[..len], frame_bytes, align, max);
            let mut seen = vec![0u8; len];
            let mut next = 0usize;
            assert!(f.count() >= 1);
            for (h, part) in f.iter() {
                assert_eq!(h.offset as usize, next);
                assert_eq!(h.len as usize, part.len());
                assert_eq!((h.seq, h.index), (2, 3));
                if h.offset as usize + part.len() < len {
                    assert_eq!(part.len() % align, 0, "{len} {frame_bytes} {align} {max}");
                    assert!(part.len() <= max.max(align));
                }
                seen[next..next + part.len()].copy_from_slice(part);
                next += part.len();
            }
            assert_eq!(next, len);
            assert_eq!(seen, &payload[..len]);
        }
    }
}
