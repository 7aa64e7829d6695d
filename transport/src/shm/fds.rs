//! The file descriptors of one shm link: the segment (a sealed memfd, so nothing is left
//! in /dev/shm when the processes end) and four eventfds, passed from the dialer to the
//! acceptor with `SCM_RIGHTS` over the link's unix socket.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use tokio::io::Interest;
use tokio::net::UnixStream;

use super::segment::{sealed_memfd, Geometry};

/// What the dialer passes: the segment, and per ring the eventfd that wakes its receiver
/// (`data`) and the one that wakes its sender (`space`).
pub(crate) struct LinkFds {
    pub segment: OwnedFd,
    pub data: [OwnedFd; 2],
    pub space: [OwnedFd; 2],
}

const NFDS: usize = 5;

fn eventfd() -> std::io::Result<OwnedFd> {
    let e = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
    Ok(OwnedFd::from(e))
}

impl LinkFds {
    /// A new sealed segment of `geo`'s size and four eventfds.
    pub fn create(geo: Geometry) -> std::io::Result<LinkFds> {
        let segment = sealed_memfd(c"eccl-shm-link", geo.segment_bytes())?;
        Ok(LinkFds {
            segment,
            data: [eventfd()?, eventfd()?],
            space: [eventfd()?, eventfd()?],
        })
    }

    fn raw(&self) -> [RawFd; NFDS] {
        [
            self.segment.as_raw_fd(),
            self.data[0].as_raw_fd(),
            self.data[1].as_raw_fd(),
            self.space[0].as_raw_fd(),
            self.space[1].as_raw_fd(),
        ]
    }
}

/// Sends `msg` and the descriptors in one message.
pub(crate) async fn send(stream: &UnixStream, msg: &[u8], fds: &LinkFds) -> std::io::Result<()> {
    let raw = fds.raw();
    let n = stream
        .async_io(Interest::WRITABLE, || {
            let iov = [IoSlice::new(msg)];
            let cmsg = [ControlMessage::ScmRights(&raw)];
            sendmsg::<()>(
                stream.as_raw_fd(),
                &iov,
                &cmsg,
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(std::io::Error::from)
        })
        .await?;
    if n != msg.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::WriteZero,
            "the set-up message was cut short",
        ));
    }
    Ok(())
}

/// Receives a message of exactly `N` bytes and the link's descriptors. Anything else (a
/// short message, missing or extra descriptors) is an error, and every descriptor that
/// did arrive is closed.
pub(crate) async fn recv<const N: usize>(
    stream: &UnixStream,
) -> std::io::Result<([u8; N], LinkFds)> {
    let (buf, got, truncated) = stream
        .async_io(Interest::READABLE, || {
            let mut buf = [0u8; N];
            let mut space = nix::cmsg_space!([RawFd; NFDS]);
            let (bytes, fds, truncated) = {
                let mut iov = [IoSliceMut::new(&mut buf)];
                let msg = recvmsg::<()>(
                    stream.as_raw_fd(),
                    &mut iov,
                    Some(&mut space),
                    MsgFlags::MSG_CMSG_CLOEXEC,
                )
                .map_err(std::io::Error::from)?;
                let mut fds: Vec<OwnedFd> = Vec::new();
                for c in msg.cmsgs().map_err(std::io::Error::from)? {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        // SAFETY: the kernel just installed these descriptors in this
                        // process for us; nothing else owns them.
                        fds.extend(
                            raw.into_iter()
                                .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                        );
                    }
                }
                (msg.bytes, fds, msg.flags.contains(MsgFlags::MSG_CTRUNC))
            };
            if bytes == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            Ok((buf[..bytes.min(N)].to_vec(), fds, truncated || bytes != N))
        })
        .await?;
    let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_string());
    if truncated || got.len() != NFDS {
        return Err(bad("the shm set-up message is malformed"));
    }
    let mut it = got.into_iter();
    let mut next = || it.next().expect("NFDS descriptors checked above");
    let fds = LinkFds {
        segment: next(),
        data: [next(), next()],
        space: [next(), next()],
    };
    // Eventfds are only ever used without blocking; make sure of it whatever was sent.
    for fd in fds.data.iter().chain(fds.space.iter()) {
        fcntl(fd.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
    }
    let mut out = [0u8; N];
    out.copy_from_slice(&buf);
    Ok((out, fds))
}

/// Wakes whoever sleeps on the eventfd `fd`.
pub(crate) fn signal(fd: &OwnedFd) {
    // An eventfd adds the value to its counter; the write fails only if the counter would
    // overflow, and then a wake-up is pending anyway.
    let _ = nix::unistd::write(fd, &1u64.to_ne_bytes());
}

/// Resets an eventfd's counter after a wake-up.
pub(crate) fn drain(fd: RawFd) {
    let mut b = [0u8; 8];
    let _ = nix::unistd::read(fd, &mut b);
}
