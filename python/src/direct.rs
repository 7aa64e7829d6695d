//! All_gather and reduce_scatter that read the other ranks' memory directly, where every
//! rank's source lies in eccl's shared memory (`SharedMemory`, what the torch backend's
//! `allocate_tensor` hands out: FSDP2's communication buffers), and over the links
//! otherwise. Every rank runs the same steps, so the choice is the same everywhere (in a
//! world across hosts, the call is the ordinary collective at once):
//!
//! 1. the ranks all_gather a small record each: where their source lies (process,
//!    descriptor, inode, offset) or that it lies elsewhere, with its size and dtype
//!    (a disagreement is a `Mismatch` on every rank, nothing written);
//! 2. where every rank's source is shared, each maps the others' regions (once: the
//!    mappings are kept) and the ranks agree by an all_reduce that every one of them
//!    could; otherwise the call is the ordinary collective over the links;
//! 3. each rank copies (all_gather) or reduces in rank order (reduce_scatter) what it
//!    needs straight from the others' memory into its output: one copy per byte where
//!    the links take two (into a link's buffer, out of it), and a reduction that reads
//!    every input where it lies;
//! 4. a barrier: no rank's source changes before every rank has read it.
//!
//! A failure (a rank that dies or is evicted) fails the barrier or an exchange on every
//! rank; the output is then undefined (as for the device calls), the inputs untouched.

use std::sync::Arc;

use eccl::{Communicator, Error, Rank, Result};
use eccl_protocol::{CollectiveKind, DType, ReduceOp};

use crate::shared::{find_own, peer_region};

/// u64s per rank in the records.
const RECORD: usize = 8;

fn dtype_code(dtype: DType) -> u64 {
    DType::ALL.iter().position(|d| *d == dtype).unwrap_or(0) as u64
}

/// This rank's record: [shared?, pid, fd, inode, region bytes, offset, bytes, dtype].
fn record(addr: usize, len: usize, dtype: DType) -> [u64; RECORD] {
    match find_own(addr, len) {
        Some((r, offset)) => [
            1,
            r.pid as u64,
            r.fd as u64,
            r.ino,
            r.len as u64,
            offset as u64,
            len as u64,
            dtype_code(dtype),
        ],
        None => [0, 0, 0, 0, 0, 0, len as u64, dtype_code(dtype)],
    }
}

/// The ranks' records, checked to agree on size and dtype; and whether every rank's
/// source is shared and mapped here (agreed by every rank): the mappings, None for
/// this rank's own.
async fn agree(
    comm: &mut Communicator,
    what: &str,
    mine: [u64; RECORD],
) -> Result<Option<Vec<(Option<Arc<eccl_shm::Region>>, usize)>>> {
    let world = comm.world_size() as usize;
    let me = rank(comm)?;
    // Sent as i64s (eccl's integer elements), bit for bit.
    let sent = mine.map(|v| v as i64);
    let mut got = vec![0i64; RECORD * world];
    comm.all_gather_into(&sent, &mut got).await?;
    let table: Vec<u64> = got.into_iter().map(|v| v as u64).collect();
    let rec = |r: usize| &table[r * RECORD..(r + 1) * RECORD];
    for r in 0..world {
        if rec(r)[6] != mine[6] || rec(r)[7] != mine[7] {
            return Err(Error::Mismatch {
                rank: Some(r as u32),
                ours: None,
                theirs: None,
                detail: format!(
                    "{what}: rank {r} moves {} bytes of dtype #{}, rank {me} {} of #{}",
                    rec(r)[6],
                    rec(r)[7],
                    mine[6],
                    mine[7]
                ),
            });
        }
    }
    if (0..world).any(|r| rec(r)[0] != 1) {
        return Ok(None);
    }
    let mut maps = Vec::with_capacity(world);
    let mut ok = 1i32;
    for r in 0..world {
        if r == me {
            maps.push((None, rec(r)[5] as usize));
            continue;
        }
        let (pid, fd, ino, len, offset) = (
            rec(r)[1] as u32,
            rec(r)[2] as i32,
            rec(r)[3],
            rec(r)[4] as usize,
            rec(r)[5] as usize,
        );
        match peer_region(pid, fd, len, ino) {
            Ok(m)
                if offset
                    .checked_add(mine[6] as usize)
                    .is_some_and(|e| e <= m.len()) =>
            {
                maps.push((Some(m), offset));
            }
            Ok(_) => {
                ok = 0;
                maps.push((None, 0));
            }
            Err(e) => {
                tracing::info!(target: "eccl::coll", "{what}: rank {r}'s memory cannot be mapped here ({e}); the call goes over the links");
                ok = 0;
                maps.push((None, 0));
            }
        }
    }
    let mut flag = [ok];
    comm.all_reduce(&mut flag, ReduceOp::Min).await?;
    Ok((flag[0] == 1).then_some(maps))
}

/// Whether every member of this epoch's world runs on one host (the world says so
/// alike to every rank, so every rank takes the same way).
fn one_host(comm: &Communicator) -> bool {
    comm.world().is_some_and(|w| {
        w.members
            .first()
            .is_some_and(|m0| w.members.iter().all(|m| m.host == m0.host))
    })
}

fn rank(comm: &Communicator) -> Result<usize> {
    comm.rank()
        .map(|r| r.0 as usize)
        .ok_or_else(|| Error::InvalidArgument("this peer has no rank in a world yet".into()))
}

/// Where rank r's bytes are: this rank's own source, or the mapped region at `offset`.
fn peer_ptr(maps: &[(Option<Arc<eccl_shm::Region>>, usize)], r: usize) -> Option<*const u8> {
    let (m, offset) = &maps[r];
    // In bounds: `agree` checked offset + bytes against the mapping's length.
    m.as_ref()
        .map(|m| m.base().wrapping_add(*offset) as *const u8)
}

/// All_gather of `output.len() / world` bytes per rank into `output`, from `input` or,
/// with `input: None`, from this rank's block of `output` (NCCL's in-place form).
/// Returns whether the ranks read each other's memory directly.
pub(crate) async fn all_gather(
    comm: &mut Communicator,
    output: &mut [u8],
    input: Option<&[u8]>,
    dtype: DType,
) -> Result<bool> {
    let world = comm.world_size() as usize;
    let me = rank(comm)?;
    if world == 0 || !output.len().is_multiple_of(world) {
        return Err(Error::InvalidArgument(format!(
            "all_gather: an output of {} bytes for {world} ranks",
            output.len()
        )));
    }
    let nb = output.len() / world;
    if input.is_some_and(|i| i.len() != nb) {
        return Err(Error::InvalidArgument(format!(
            "all_gather: an input of {} bytes for blocks of {nb}",
            input.map_or(0, |i| i.len())
        )));
    }
    let src = match input {
        Some(i) => i.as_ptr() as usize,
        None => output[me * nb..].as_ptr() as usize,
    };
    let maps = if one_host(comm) {
        agree(comm, "all_gather", record(src, nb, dtype)).await?
    } else {
        None
    };
    let Some(maps) = maps else {
        let count = nb / dtype.size();
        let args = eccl::CollArgs::for_buffers(
            CollectiveKind::AllGather,
            dtype,
            ReduceOp::Sum,
            Rank(0),
            Some(count),
            Some(count * world),
            world as u32,
        );
        let own;
        let inp = match input {
            Some(i) => i,
            None => {
                own = output[me * nb..(me + 1) * nb].to_vec();
                &own
            }
        };
        comm.collective(args, inp, output).await?;
        return Ok(false);
    };
    for r in 0..world {
        let dst = &mut output[r * nb..(r + 1) * nb];
        if r == me {
            if let Some(i) = input {
                dst.copy_from_slice(i);
            }
            continue;
        }
        let p = peer_ptr(&maps, r).expect("every other rank's source is mapped");
        // SAFETY: `p` points at `nb` bytes inside rank r's live mapping (checked in
        // `agree`; the Arc keeps it mapped), which rank r does not change until the
        // barrier below; `dst` is this rank's output, apart from every mapping of
        // another process's region.
        unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr(), nb) };
    }
    comm.barrier().await?;
    Ok(true)
}

/// Reduce_scatter: `input` holds world blocks of `output.len()` bytes; rank r's output
/// is block r of every rank's input reduced with `op` in rank order. Returns whether
/// the ranks read each other's memory directly.
pub(crate) async fn reduce_scatter(
    comm: &mut Communicator,
    output: &mut [u8],
    input: &[u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<bool> {
    let world = comm.world_size() as usize;
    let me = rank(comm)?;
    let nb = output.len();
    if input.len() != nb * world {
        return Err(Error::InvalidArgument(format!(
            "reduce_scatter: an input of {} bytes for {world} blocks of {nb}",
            input.len()
        )));
    }
    let maps = if one_host(comm) {
        let mine = record(input.as_ptr() as usize, input.len(), dtype);
        agree(comm, "reduce_scatter", mine).await?
    } else {
        None
    };
    let Some(maps) = maps else {
        let count = nb / dtype.size();
        let args = eccl::CollArgs::for_buffers(
            CollectiveKind::ReduceScatter,
            dtype,
            op,
            Rank(0),
            Some(count * world),
            Some(count),
            world as u32,
        );
        comm.collective(args, input, output).await?;
        return Ok(false);
    };
    let block = |r: usize| -> &[u8] {
        match peer_ptr(&maps, r) {
            // SAFETY: rank r's whole input (world blocks of `nb`) lies inside its live
            // mapping (checked in `agree`), unchanged until the barrier below; block
            // `me` of it is read only.
            Some(p) => unsafe { std::slice::from_raw_parts(p.wrapping_add(me * nb), nb) },
            None => &input[me * nb..(me + 1) * nb],
        }
    };
    output.copy_from_slice(block(0));
    for r in 1..world {
        eccl_algorithms::kernels::reduce_inplace(dtype, op, output, block(r));
    }
    eccl_algorithms::kernels::finalize(dtype, op, output, world);
    comm.barrier().await?;
    Ok(true)
}
