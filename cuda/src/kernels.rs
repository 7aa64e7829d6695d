//! The device reduction kernels, generated as CUDA C from the tables that define eccl's
//! element types ([`DType::ALL`]) and operators ([`ReduceOp::ALL`]): a new row in either
//! table is a new kernel here, and a type or operator this file cannot express fails to
//! compile (the matches below are exhaustive), so the lists cannot drift apart.
//!
//! Each kernel has the CPU kernels' exact semantics (`eccl_algorithms::kernels`), so a
//! reduction gives the same bits on the device as on the host (G3): integers wrap, `min`
//! and `max` keep `a` only when `a < b` (or `a > b`) as the CPU does, `f16`/`bf16` widen to
//! `f32`, combine, and round to nearest-even after every step with the same bit-level
//! conversions as the `half` crate (NaN payloads included), and `avg` divides the sum
//! once by the world size in `f32` (`f64` for `f64`). They are compiled without fast math
//! (no flush to zero, IEEE division), and each step is one operation, so no contraction
//! into a fused multiply-add can change a result.
//!
//! One kernel per (dtype, op) pair reads `nin` inputs and writes the combined value to
//! `nout` outputs (up to [`MAX_PTRS`] each): a same-host all_reduce reduces a chunk from
//! every rank's buffer and writes the result into every rank's buffer in one pass.

use eccl_protocol::{DType, NumClass, ReduceOp};

/// Most inputs or outputs one kernel launch takes (the ranks of one host it serves).
pub const MAX_PTRS: usize = 8;

/// Threads per block for every generated kernel.
pub const BLOCK: u32 = 256;

/// The operator a kernel runs for `op`: `avg` is a sum divided once at the end.
pub fn kernel_op(op: ReduceOp) -> ReduceOp {
    match op {
        ReduceOp::Avg => ReduceOp::Sum,
        other => other,
    }
}

/// The pairs that have a kernel of their own (`avg` runs its dtype's `sum` kernel).
pub fn pairs() -> impl Iterator<Item = (DType, ReduceOp)> {
    DType::ALL.into_iter().flat_map(|d| {
        ReduceOp::ALL
            .into_iter()
            .filter(move |&o| o.valid_for(d) && kernel_op(o) == o)
            .map(move |o| (d, o))
    })
}

/// The kernel's symbol for a (dtype, op) pair, `avg` mapped to `sum`.
pub fn kernel_name(dtype: DType, op: ReduceOp) -> String {
    format!("eccl_reduce_{}_{}", dtype.name(), kernel_op(op).name())
}

/// How a dtype is stored and widened in CUDA C.
struct CType {
    /// The storage type.
    store: &'static str,
    /// The functions into and out of the type arithmetic happens in (f32 for the halves).
    widen: &'static str,
    narrow: &'static str,
}

fn ctype(dtype: DType) -> CType {
    let plain = |t: &'static str| CType {
        store: t,
        widen: "",
        narrow: "",
    };
    match dtype {
        DType::F32 => plain("float"),
        DType::F64 => plain("double"),
        DType::F16 => CType {
            store: "unsigned short",
            widen: "f16_to_f32",
            narrow: "f32_to_f16",
        },
        DType::BF16 => CType {
            store: "unsigned short",
            widen: "bf16_to_f32",
            narrow: "f32_to_bf16",
        },
        DType::I8 => plain("signed char"),
        DType::U8 => plain("unsigned char"),
        DType::I32 => plain("int"),
        DType::I64 => plain("long long"),
    }
}

/// The unsigned type of an integer dtype's width, for wrapping arithmetic (signed
/// overflow is undefined in C, wrapping is what the CPU kernels do).
fn unsigned_of(dtype: DType) -> &'static str {
    match dtype.size() {
        1 => "unsigned char",
        2 => "unsigned short",
        4 => "unsigned int",
        _ => "unsigned long long",
    }
}

/// The body of `T f(T a, T b)` for one pair.
fn combine(dtype: DType, op: ReduceOp) -> String {
    let c = ctype(dtype);
    match dtype.class() {
        NumClass::Float | NumClass::BFloat => {
            let (w, n) = (c.widen, c.narrow);
            match kernel_op(op) {
                ReduceOp::Sum => format!("return {n}({w}(a) + {w}(b));"),
                ReduceOp::Prod => format!("return {n}({w}(a) * {w}(b));"),
                ReduceOp::Min => format!("return {w}(a) < {w}(b) ? a : b;"),
                ReduceOp::Max => format!("return {w}(a) > {w}(b) ? a : b;"),
                ReduceOp::Avg | ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {
                    unreachable!("no float kernel for {op:?}")
                }
            }
        }
        NumClass::Signed | NumClass::Unsigned => {
            let (t, u) = (c.store, unsigned_of(dtype));
            match kernel_op(op) {
                ReduceOp::Sum => format!("return ({t})(({u})a + ({u})b);"),
                ReduceOp::Prod => format!("return ({t})(({u})a * ({u})b);"),
                ReduceOp::Min => "return a < b ? a : b;".to_string(),
                ReduceOp::Max => "return a > b ? a : b;".to_string(),
                ReduceOp::BAnd => format!("return ({t})(a & b);"),
                ReduceOp::BOr => format!("return ({t})(a | b);"),
                ReduceOp::BXor => format!("return ({t})(a ^ b);"),
                ReduceOp::Avg => unreachable!("avg runs the sum kernel"),
            }
        }
    }
}

/// The body of `T fin(T x, double world)`: `avg`'s one division (the CPU's `finalize`).
fn finalize(dtype: DType) -> String {
    let c = ctype(dtype);
    match dtype.class() {
        NumClass::Float | NumClass::BFloat => {
            let w = if dtype == DType::F64 {
                "world"
            } else {
                "(float)world"
            };
            format!("return {}({}(x) / {w});", c.narrow, c.widen)
        }
        NumClass::Signed | NumClass::Unsigned => "return x;".to_string(),
    }
}

const PRELUDE: &str = r#"
// Generated by eccl-cuda from eccl's dtype and operator tables; do not edit.
struct EcclPtrs { unsigned long long p[8]; };

// The half crate's conversions, bit for bit (round to nearest even, NaN payloads kept).
__device__ __forceinline__ float u32_as_f32(unsigned int x) { return __int_as_float((int)x); }
__device__ __forceinline__ unsigned int f32_as_u32(float x) { return (unsigned int)__float_as_int(x); }

__device__ __forceinline__ float f16_to_f32(unsigned short i) {
    if ((i & 0x7FFFu) == 0) return u32_as_f32(((unsigned int)i) << 16);
    unsigned int sign = ((unsigned int)(i & 0x8000u)) << 16;
    unsigned int exp = i & 0x7C00u;
    unsigned int man = i & 0x03FFu;
    if (exp == 0x7C00u) {
        if (man == 0) return u32_as_f32(sign | 0x7F800000u);
        return u32_as_f32(sign | 0x7FC00000u | (man << 13));
    }
    int unbiased = ((int)exp >> 10) - 15;
    if (exp == 0) {
        int e = __clz(man) - 16 - 6;
        unsigned int fexp = ((unsigned int)(127 - 15 - e)) << 23;
        unsigned int fman = (man << (14 + e)) & 0x7FFFFFu;
        return u32_as_f32(sign | fexp | fman);
    }
    return u32_as_f32(sign | (((unsigned int)(unbiased + 127)) << 23) | (man << 13));
}

__device__ __forceinline__ unsigned short f32_to_f16(float value) {
    unsigned int x = f32_as_u32(value);
    unsigned int sign = x & 0x80000000u;
    unsigned int exp = x & 0x7F800000u;
    unsigned int man = x & 0x007FFFFFu;
    if (exp == 0x7F800000u) {
        unsigned int nan_bit = man == 0 ? 0u : 0x0200u;
        return (unsigned short)((sign >> 16) | 0x7C00u | nan_bit | (man >> 13));
    }
    unsigned int half_sign = sign >> 16;
    int half_exp = ((int)(exp >> 23)) - 127 + 15;
    if (half_exp >= 0x1F) return (unsigned short)(half_sign | 0x7C00u);
    if (half_exp <= 0) {
        if (14 - half_exp > 24) return (unsigned short)half_sign;
        unsigned int m = man | 0x00800000u;
        unsigned int half_man = m >> (14 - half_exp);
        unsigned int round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0 && (m & (3u * round_bit - 1u)) != 0) half_man += 1;
        return (unsigned short)(half_sign | half_man);
    }
    unsigned int he = ((unsigned int)half_exp) << 10;
    unsigned int hm = man >> 13;
    unsigned int round_bit = 0x00001000u;
    if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0)
        return (unsigned short)((half_sign | he | hm) + 1u);
    return (unsigned short)(half_sign | he | hm);
}

__device__ __forceinline__ float bf16_to_f32(unsigned short i) {
    return u32_as_f32(((unsigned int)i) << 16);
}

__device__ __forceinline__ unsigned short f32_to_bf16(float value) {
    unsigned int x = f32_as_u32(value);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((x >> 16) | 0x0040u);
    unsigned int round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0)
        return (unsigned short)((x >> 16) + 1u);
    return (unsigned short)(x >> 16);
}

// out[k][i] = fin(in[0][i] op in[1][i] op ... op in[nin-1][i]) for every output k, in rank
// order, so every rank's result has the same bits. 16-byte loads and stores when every
// pointer is 16-byte aligned, one element at a time otherwise and for the tail.
template <typename F>
__device__ __forceinline__ void eccl_reduce_body(EcclPtrs in, int nin, EcclPtrs out, int nout,
                                                 unsigned long long n, double world) {
    typedef typename F::T T;
    const int V = 16 / (int)sizeof(T);
    unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long bits = 0;
    for (int k = 0; k < nin; k++) bits |= in.p[k];
    for (int k = 0; k < nout; k++) bits |= out.p[k];
    unsigned long long nv = (bits & 15ull) == 0 ? n / V : 0;
    for (unsigned long long v = tid; v < nv; v += stride) {
        uint4 acc = ((const uint4*)in.p[0])[v];
        T* a = (T*)&acc;
        for (int k = 1; k < nin; k++) {
            uint4 y = ((const uint4*)in.p[k])[v];
            const T* b = (const T*)&y;
#pragma unroll
            for (int j = 0; j < V; j++) a[j] = F::f(a[j], b[j]);
        }
        if (world > 1.0) {
#pragma unroll
            for (int j = 0; j < V; j++) a[j] = F::fin(a[j], world);
        }
        for (int k = 0; k < nout; k++) ((uint4*)out.p[k])[v] = acc;
    }
    for (unsigned long long i = nv * V + tid; i < n; i += stride) {
        T a = ((const T*)in.p[0])[i];
        for (int k = 1; k < nin; k++) a = F::f(a, ((const T*)in.p[k])[i]);
        if (world > 1.0) a = F::fin(a, world);
        for (int k = 0; k < nout; k++) ((T*)out.p[k])[i] = a;
    }
}
"#;

/// The CUDA C source of every kernel: one functor and one `extern "C"` entry point per
/// pair from [`pairs`].
pub fn source() -> String {
    let mut s = String::from(PRELUDE);
    for (dtype, op) in pairs() {
        let c = ctype(dtype);
        let name = kernel_name(dtype, op);
        s.push_str(&format!(
            "\nstruct F_{name} {{\n    typedef {t} T;\n    \
             static __device__ __forceinline__ T f(T a, T b) {{ {body} }}\n    \
             static __device__ __forceinline__ T fin(T x, double world) {{ {fin} }}\n}};\n\
             extern \"C\" __global__ void {name}(EcclPtrs in, int nin, EcclPtrs out, int nout,\n    \
             unsigned long long n, double world) {{\n    \
             eccl_reduce_body<F_{name}>(in, nin, out, nout, n, world);\n}}\n",
            t = c.store,
            body = combine(dtype, op),
            fin = finalize(dtype),
        ));
    }
    s
}

/// Blocks for `count` elements of `dtype`: enough 16-byte vectors per thread to cover the
/// buffer, at most `max_blocks` (the grid strides over the rest).
pub fn grid(dtype: DType, count: usize, max_blocks: u32) -> u32 {
    let per_vec = (16 / dtype.size()).max(1);
    let vecs = count.div_ceil(per_vec).max(1);
    let blocks = vecs.div_ceil(BLOCK as usize);
    blocks.clamp(1, max_blocks.max(1) as usize) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_defined_pair_but_avg_has_one_kernel() {
        let names: Vec<String> = pairs().map(|(d, o)| kernel_name(d, o)).collect();
        let floats = DType::ALL.iter().filter(|d| d.is_float()).count();
        let ints = DType::ALL.len() - floats;
        // sum, prod, min, max for floats; those and three bitwise ops for integers.
        assert_eq!(names.len(), floats * 4 + ints * 7);
        let src = source();
        for n in &names {
            assert_eq!(src.matches(&format!("void {n}(")).count(), 1, "{n}");
        }
        assert_eq!(
            kernel_name(DType::F32, ReduceOp::Avg),
            "eccl_reduce_f32_sum"
        );
        assert!(!names.iter().any(|n| n.ends_with("_avg")));
    }

    #[test]
    fn integer_arithmetic_wraps_through_the_unsigned_type() {
        assert_eq!(
            combine(DType::I8, ReduceOp::Sum),
            "return (signed char)((unsigned char)a + (unsigned char)b);"
        );
        assert_eq!(
            combine(DType::I64, ReduceOp::Prod),
            "return (long long)((unsigned long long)a * (unsigned long long)b);"
        );
    }

    #[test]
    fn halves_round_after_every_step_and_avg_divides_in_f32() {
        assert_eq!(
            combine(DType::BF16, ReduceOp::Sum),
            "return f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b));"
        );
        assert_eq!(
            finalize(DType::F16),
            "return f32_to_f16(f16_to_f32(x) / (float)world);"
        );
        assert_eq!(finalize(DType::F64), "return ((x) / world);");
    }

    #[test]
    fn the_grid_covers_the_buffer_in_vectors_and_is_capped() {
        assert_eq!(grid(DType::F32, 1, 1024), 1);
        assert_eq!(grid(DType::F32, 4 * 256, 1024), 1);
        assert_eq!(grid(DType::F32, 4 * 256 + 1, 1024), 2);
        assert_eq!(grid(DType::I8, 1 << 30, 1024), 1024);
    }
}
