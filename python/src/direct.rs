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
const RECORD: usize = 12;

/// Which call a record is of (a rank in the other would find sizes alike otherwise).
const KIND_ALL_GATHER: u64 = 1;
const KIND_REDUCE_SCATTER: u64 = 2;

fn code<T: PartialEq + Copy>(all: &[T], v: T) -> u64 {
    all.iter().position(|x| *x == v).unwrap_or(usize::MAX) as u64
}

/// This kernel's boot, so that ranks that only share a host id (`ECCL_HOST_ID` set
/// alike on two machines) never take each other's descriptors for their own.
fn boot() -> u64 {
    static BOOT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *BOOT.get_or_init(|| {
        let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let hex: String = id
            .chars()
            .filter(char::is_ascii_hexdigit)
            .take(15)
            .collect();
        u64::from_str_radix(&hex, 16).unwrap_or(0)
    })
}

/// What one rank tells the others before a shared collective. A rank whose own
/// arguments are wrong says so here (`bad`), so that every rank fails alike after the
/// exchange instead of that rank alone before it (the others would wait in it).
struct Mine<'a> {
    kind: u64,
    op: ReduceOp,
    dtype: DType,
    /// Bytes this rank's source holds (what the others read of it).
    bytes: usize,
    /// The source's address, None where the arguments are wrong.
    src: Option<usize>,
    bad: Option<&'a str>,
}

/// [shared?, pid, fd, inode, region bytes, offset, bytes, dtype, kind, op, bad, boot].
fn record(m: &Mine<'_>) -> [u64; RECORD] {
    let own = m.src.and_then(|a| find_own(a, m.bytes));
    let mut r = [0u64; RECORD];
    if let Some((region, offset)) = own {
        r[..6].copy_from_slice(&[
            1,
            region.pid as u64,
            region.fd as u64,
            region.ino,
            region.len as u64,
            offset as u64,
        ]);
    }
    r[6] = m.bytes as u64;
    r[7] = code(&DType::ALL, m.dtype);
    r[8] = m.kind;
    r[9] = code(&ReduceOp::ALL, m.op);
    r[10] = m.bad.is_some() as u64;
    r[11] = boot();
    r
}

/// Mapped sources, by rank (None: this rank's own) with their offsets.
type Maps = Vec<(Option<Arc<eccl_shm::Region>>, usize)>;

/// The ranks' records exchanged and checked alike on every rank (arguments, call, size,
/// dtype, op); then whether every rank's source is shared and mapped here, agreed by all
/// ranks: the mappings, or None for the ordinary collective.
async fn agree(comm: &mut Communicator, what: &str, m: &Mine<'_>) -> Result<Option<Maps>> {
    let world = comm.world_size() as usize;
    let me = rank(comm)?;
    let mine = record(m);
    // Sent as i64s (eccl's integer elements), bit for bit.
    let sent = mine.map(|v| v as i64);
    let mut got = vec![0i64; RECORD * world];
    comm.all_gather_into(&sent, &mut got).await?;
    let table: Vec<u64> = got.into_iter().map(|v| v as u64).collect();
    let rec = |r: usize| &table[r * RECORD..(r + 1) * RECORD];
    if let Some(r) = (0..world).find(|&r| rec(r)[10] != 0) {
        return Err(Error::InvalidArgument(match m.bad {
            Some(why) if r == me => format!("{what}: {why}"),
            _ => format!("{what}: rank {r}'s arguments are wrong (its error says how)"),
        }));
    }
    for r in 0..world {
        if rec(r)[6..10] != mine[6..10] {
            return Err(Error::Mismatch {
                rank: Some(r as u32),
                ours: None,
                theirs: None,
                detail: format!(
                    "{what}: rank {r} calls #{} with {} bytes of dtype #{} and op #{}, rank \
                     {me} #{} with {} of #{} and #{}",
                    rec(r)[8],
                    rec(r)[6],
                    rec(r)[7],
                    rec(r)[9],
                    mine[8],
                    mine[6],
                    mine[7],
                    mine[9]
                ),
            });
        }
    }
    if m.kind == KIND_REDUCE_SCATTER && !m.op.valid_for(m.dtype) {
        return Err(Error::InvalidArgument(format!(
            "{what}: {} is not defined for {} (avg needs a floating type, band/bor/bxor an \
             integer type)",
            m.op, m.dtype
        )));
    }
    if (0..world).any(|r| rec(r)[0] != 1 || rec(r)[11] != mine[11]) {
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
            Ok(region)
                if offset
                    .checked_add(m.bytes)
                    .is_some_and(|e| e <= region.len()) =>
            {
                maps.push((Some(region), offset));
            }
            _ => {
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

/// The ordinary collective over the links (the way taken where some rank's buffer is
/// not shared, or the world spans hosts); its own checks judge the sizes.
async fn over_links(
    comm: &mut Communicator,
    kind: CollectiveKind,
    dtype: DType,
    op: ReduceOp,
    input: &[u8],
    output: &mut [u8],
) -> Result<bool> {
    let elem = dtype.size();
    let args = eccl::CollArgs::for_buffers(
        kind,
        dtype,
        op,
        Rank(0),
        Some(input.len() / elem),
        Some(output.len() / elem),
        comm.world_size(),
    );
    comm.collective(args, input, output).await?;
    Ok(false)
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
    let elem = dtype.size();
    let nb = output.len() / world.max(1);
    let bad = if world == 0 || !output.len().is_multiple_of(world * elem) {
        Some("the output is not world x whole elements")
    } else if input.is_some_and(|i| i.len() != nb) {
        Some("the input is not the size of one block of the output")
    } else {
        None
    };
    let src = match (bad, input) {
        (Some(_), _) => None,
        (None, Some(i)) => Some(i.as_ptr() as usize),
        (None, None) => Some(output[me * nb..].as_ptr() as usize),
    };
    let mine = Mine {
        kind: KIND_ALL_GATHER,
        op: ReduceOp::Sum,
        dtype,
        bytes: nb,
        src,
        bad,
    };
    let maps = if one_host(comm) {
        agree(comm, "all_gather", &mine).await?
    } else {
        None
    };
    let Some(maps) = maps else {
        let own;
        let inp = match input {
            Some(i) => i,
            None if bad.is_none() => {
                own = output[me * nb..(me + 1) * nb].to_vec();
                &own
            }
            // Wrong sizes across hosts: the collective's own checks fail every rank.
            None => &[],
        };
        return over_links(
            comm,
            CollectiveKind::AllGather,
            dtype,
            ReduceOp::Sum,
            inp,
            output,
        )
        .await;
    };
    // Copies of whole blocks can take a while: the runtime's other tasks (the lease's
    // heartbeat, other communicators' links) move to another thread meanwhile.
    tokio::task::block_in_place(|| {
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
            // `agree`; the Arc keeps it mapped), which rank r leaves alone until the
            // barrier below (if rank r's part failed meanwhile, this call fails at the
            // barrier and the bytes read are dropped with its output); `dst` is this
            // rank's output, apart from every mapping of another process's region.
            unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr(), nb) };
        }
    });
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
    let bad = if !nb.is_multiple_of(dtype.size()) {
        Some("the output is not whole elements")
    } else if input.len() != nb * world {
        Some("the input is not world blocks of the output's size")
    } else {
        None
    };
    let mine = Mine {
        kind: KIND_REDUCE_SCATTER,
        op,
        dtype,
        bytes: input.len(),
        src: bad.is_none().then_some(input.as_ptr() as usize),
        bad,
    };
    let maps = if one_host(comm) {
        agree(comm, "reduce_scatter", &mine).await?
    } else {
        None
    };
    let Some(maps) = maps else {
        return over_links(
            comm,
            CollectiveKind::ReduceScatter,
            dtype,
            op,
            input,
            output,
        )
        .await;
    };
    let block = |r: usize| -> &[u8] {
        match peer_ptr(&maps, r) {
            // SAFETY: rank r's whole input (world blocks of `nb`) lies inside its live
            // mapping (checked in `agree`), which rank r leaves alone until the barrier
            // below; block `me` of it is read only. (If rank r's part failed meanwhile
            // and it reused the memory, this call fails at the barrier and what was
            // read is dropped with its output.)
            Some(p) => unsafe { std::slice::from_raw_parts(p.wrapping_add(me * nb), nb) },
            None => &input[me * nb..(me + 1) * nb],
        }
    };
    tokio::task::block_in_place(|| {
        output.copy_from_slice(block(0));
        for r in 1..world {
            eccl_algorithms::kernels::reduce_inplace(dtype, op, output, block(r));
        }
        eccl_algorithms::kernels::finalize(dtype, op, output, world);
    });
    comm.barrier().await?;
    Ok(true)
}
