# V41_CHECK_CUDA: --with-cuda=guess|no|DIR, --with-cuda-arch=ARCH (UCX-style).
# Sets have_cuda, CUDA_CFLAGS, CUDA_LIBS, NVCC, NVCCFLAGS, CUDA_ARCH and
# AM_CONDITIONAL HAVE_CUDA. Error when CUDA was requested and is missing,
# warning when it was only guessed.
AC_DEFUN([V41_CHECK_CUDA], [
  AC_ARG_WITH([cuda],
    [AS_HELP_STRING([--with-cuda=guess|no|DIR], [build the CUDA engine (default: guess, /usr/local/cuda)])],
    [], [with_cuda=guess])
  AC_ARG_WITH([cuda-arch],
    [AS_HELP_STRING([--with-cuda-arch=ARCH], [GPU arch for nvcc (default: sm_90a, plus PTX)])],
    [], [with_cuda_arch=sm_90a])
  have_cuda=no
  CUDA_CFLAGS=""; CUDA_LIBS=""; NVCC=""
  AS_IF([test "x$with_cuda" != xno], [
    AS_IF([test "x$with_cuda" = xguess || test "x$with_cuda" = xyes],
          [cuda_dirs="$CUDA_HOME /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-12"],
          [cuda_dirs="$with_cuda"])
    for d in $cuda_dirs; do
      AS_IF([test -x "$d/bin/nvcc" && test -f "$d/include/cuda_runtime.h"], [cuda_dir=$d; break])
    done
    AS_IF([test -n "$cuda_dir"], [
      save_CPPFLAGS=$CPPFLAGS; save_LIBS=$LIBS; save_LDFLAGS=$LDFLAGS
      for libd in lib64 lib targets/x86_64-linux/lib; do
        AS_IF([test -d "$cuda_dir/$libd"], [cuda_libdir="$cuda_dir/$libd"; break])
      done
      CPPFLAGS="$CPPFLAGS -I$cuda_dir/include"
      LDFLAGS="$LDFLAGS -L$cuda_libdir"
      AC_CHECK_HEADER([cublas_v2.h], [
        AC_CHECK_LIB([cudart], [cudaMalloc], [
          AC_CHECK_LIB([cublas], [cublasCreate_v2], [have_cuda=yes], [], [-lcudart])])])
      CPPFLAGS=$save_CPPFLAGS; LIBS=$save_LIBS; LDFLAGS=$save_LDFLAGS
    ])
    AS_IF([test "x$have_cuda" = xyes], [
      NVCC="$cuda_dir/bin/nvcc"
      CUDA_CFLAGS="-I$cuda_dir/include"
      CUDA_LIBS="-L$cuda_libdir -Wl,-rpath,$cuda_libdir -lcublasLt -lcublas -lcudart"
      CUDA_ARCH=$with_cuda_arch
      cuda_arch_num=`echo $CUDA_ARCH | sed 's/^sm_//; s/a$//'`
      NVCCFLAGS="-O3 -std=c++17 -lineinfo -gencode arch=compute_$(echo $CUDA_ARCH | sed 's/^sm_//'),code=$CUDA_ARCH -gencode arch=compute_${cuda_arch_num},code=compute_${cuda_arch_num} -Xcompiler -fPIC,-Wall"
      AC_DEFINE([HAVE_CUDA], [1], [the CUDA engine is built])
      AC_DEFINE_UNQUOTED([V41_CUDA_ARCH], ["$CUDA_ARCH"], [nvcc target arch])
    ], [
      AS_IF([test "x$with_cuda" = xguess],
        [AC_MSG_WARN([CUDA/cuBLAS not found; building without the GPU engine (use --with-cuda=DIR)])],
        [AC_MSG_ERROR([CUDA requested (--with-cuda=$with_cuda) but nvcc/cuda_runtime.h/cublas were not found there])])
    ])
  ])
  AC_SUBST([NVCC])
  AC_SUBST([NVCCFLAGS])
  AC_SUBST([CUDA_CFLAGS])
  AC_SUBST([CUDA_LIBS])
  AC_SUBST([CUDA_ARCH])
  AM_CONDITIONAL([HAVE_CUDA], [test "x$have_cuda" = xyes])
])
