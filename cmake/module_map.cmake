# The module map's link lines, for the test that holds docs/design.md section 1.2 to them
# (tools/check-module-map, CTest arch_module_map): one line per rackrun target (every
# library named rackrun_*, and the executables rackrun, rackrun-worker,
# rackrun-coordinator) with its folder and its direct rackrun_* dependencies, PUBLIC and
# PRIVATE, as its target_link_libraries name them:
#   TARGET FOLDER [DEPENDENCY...]
# Targets this build does not make (the GPU engine without nvcc) are listed as
#   absent TARGET...
# Called once at the end of the top-level CMakeLists.txt, when every target exists.
function(rackrun_write_module_map path)
  set(lines "")
  set(dirs ${PROJECT_SOURCE_DIR})
  while(dirs)
    list(POP_FRONT dirs dir)
    get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
    list(APPEND dirs ${subdirs})
    get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
    foreach(target ${targets})
      if(NOT target MATCHES "^rackrun(_.*|-worker|-coordinator)?$")
        continue()
      endif()
      get_target_property(type ${target} TYPE)
      if(type STREQUAL "INTERFACE_LIBRARY")
        get_target_property(libs ${target} INTERFACE_LINK_LIBRARIES)
      else()
        get_target_property(libs ${target} LINK_LIBRARIES)
      endif()
      set(deps "")
      if(libs)
        # Plain names and names inside generator expressions alike.
        string(REGEX MATCHALL "rackrun_[A-Za-z0-9_]+" found "${libs}")
        list(REMOVE_DUPLICATES found)
        list(REMOVE_ITEM found ${target})
        list(SORT found)
        string(REPLACE ";" " " deps "${found}")
      endif()
      file(RELATIVE_PATH folder ${PROJECT_SOURCE_DIR} ${dir})
      string(STRIP "${target} ${folder} ${deps}" line)
      list(APPEND lines "${line}")
    endforeach()
  endwhile()
  list(SORT lines)
  if(NOT RACKRUN_HAVE_CUDA)
    list(APPEND lines "absent rackrun_cuda rackrun_cuda_host rackrun_cuda_kernels rackrun_cuda_sim")
    list(APPEND lines "absent rackrun_gpu_engine_sim rackrun_cudasim rackrun_cudasim_blas")
  endif()
  string(REPLACE ";" "\n" text "${lines}")
  rackrun_write_if_changed(${path} "${text}\n")
endfunction()
