"""PrimFunc attributes a kernel sets to steer its own build (kernels.build reads them).

A leaf module, so that the kernel modules setting them need not import the build, which imports them.
"""

# TVM's storage rewrite must not let one workgroup buffer reuse another's storage.
# It does so whatever their types, which WGSL cannot express: a kernel whose workgroup buffers of
# different types live one after the other sets it (the decode matmuls' quantizes_x prologue).
KEEP_WORKGROUP_BUFFERS_APART = "project.keep_workgroup_buffers_apart"
