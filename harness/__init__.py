"""What the tests and the benchmarks both use, owned by neither: the float64 oracle
(``oracle``), every head implementation behind one call (``precision``), compiling for TPU
topologies and Triton sm_90 cubins without the hardware (``tpu_compile``,
``triton_compile``), the compiled memory of a train step (``memory``) and the machine a
benchmark ran on (``machine``). It imports
neither ``tests`` nor ``benchmarks``; it runs from a checkout and is not packaged."""
