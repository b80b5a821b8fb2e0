# Obtains the pinned llama.cpp tree and applies our patch series to a private copy of it.
#
# The pristine tree comes from the llama-cpp-python sdist on PyPI (vendor/llama.cpp), downloaded once into a cache
# outside the repository, or from LLAMA_CPP_SOURCE_DIR (a pristine llama.cpp tree, for machines without a registry).
# The patched copy lives in the cache too, so that an unchanged patch series keeps file times stable and rebuilds
# stay incremental. When the series changes, only the files it touches are restored from the pristine tree.
# What is unpacked or copied goes to a temporary folder first and takes its name once complete, and the download is
# checked against its sha256, so that an interrupted or damaged step is redone instead of kept.
#
# Output: PYKVCACHE_LLAMA_DIR - the patched llama.cpp source tree

set(PYKVCACHE_LLAMA_CPP_PYTHON_VERSION "0.3.36")
set(PYKVCACHE_LLAMA_CPP_PYTHON_SHA256  "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
set(_version_hint "the llama.cpp that llama-cpp-python ${PYKVCACHE_LLAMA_CPP_PYTHON_VERSION} vendors (its sdist's vendor/llama.cpp)")

if (DEFINED ENV{PYKVCACHE_CACHE_DIR})
    set(_cache_root "$ENV{PYKVCACHE_CACHE_DIR}")
elseif (DEFINED ENV{XDG_CACHE_HOME})
    set(_cache_root "$ENV{XDG_CACHE_HOME}/pykvcache")
else()
    set(_cache_root "$ENV{HOME}/.cache/pykvcache")
endif()
# from the environment at every configure (a build folder kept from an earlier run follows a moved cache)
set(PYKVCACHE_CACHE_DIR "${_cache_root}" CACHE PATH "download and patched-source cache of pykvcache (outside the repo)" FORCE)

if (NOT LLAMA_CPP_SOURCE_DIR AND DEFINED ENV{LLAMA_CPP_SOURCE_DIR})
    set(LLAMA_CPP_SOURCE_DIR "$ENV{LLAMA_CPP_SOURCE_DIR}")
endif()

if (LLAMA_CPP_SOURCE_DIR)
    get_filename_component(LLAMA_CPP_SOURCE_DIR "${LLAMA_CPP_SOURCE_DIR}" ABSOLUTE BASE_DIR "${CMAKE_SOURCE_DIR}")
    if (NOT EXISTS "${LLAMA_CPP_SOURCE_DIR}/src/llama-context.cpp")
        message(FATAL_ERROR "LLAMA_CPP_SOURCE_DIR=${LLAMA_CPP_SOURCE_DIR} is not a llama.cpp source tree (no "
                            "src/llama-context.cpp); it must be ${_version_hint}")
    endif()
    set(_pristine "${LLAMA_CPP_SOURCE_DIR}")
    string(MD5 _src_hash "${LLAMA_CPP_SOURCE_DIR}")
    string(SUBSTRING "${_src_hash}" 0 8 _src_hash)
    set(_patched "${PYKVCACHE_CACHE_DIR}/llama.cpp-patched-${_src_hash}")
else()
    set(_sdist_name "llama_cpp_python-${PYKVCACHE_LLAMA_CPP_PYTHON_VERSION}")
    set(_sdist_dir  "${PYKVCACHE_CACHE_DIR}/sdist")
    set(_sdist_tgz  "${_sdist_dir}/${_sdist_name}.tar.gz")
    set(_pristine   "${_sdist_dir}/${_sdist_name}/vendor/llama.cpp")
    set(_patched    "${PYKVCACHE_CACHE_DIR}/llama.cpp-${PYKVCACHE_LLAMA_CPP_PYTHON_VERSION}-patched")

    if (EXISTS "${_sdist_tgz}")
        file(SHA256 "${_sdist_tgz}" _sha)
        if (NOT _sha STREQUAL PYKVCACHE_LLAMA_CPP_PYTHON_SHA256)
            message(STATUS "pykvcache: ${_sdist_tgz} is damaged (sha256 ${_sha}): downloading it again")
            file(REMOVE "${_sdist_tgz}")
            file(REMOVE_RECURSE "${_sdist_dir}/${_sdist_name}")
        endif()
    endif()
    if (NOT EXISTS "${_sdist_tgz}")
        if (Python_EXECUTABLE)
            set(_python "${Python_EXECUTABLE}") # set by scikit-build-core: the build environment, which has pip
        else()
            find_package(Python3 COMPONENTS Interpreter REQUIRED)
            set(_python "${Python3_EXECUTABLE}")
        endif()
        message(STATUS "pykvcache: downloading llama-cpp-python==${PYKVCACHE_LLAMA_CPP_PYTHON_VERSION} sdist into ${_sdist_dir}")
        execute_process(
            COMMAND ${_python} -m pip download --no-deps --no-binary :all: --no-build-isolation
                    "llama-cpp-python==${PYKVCACHE_LLAMA_CPP_PYTHON_VERSION}" -d "${_sdist_dir}"
            RESULT_VARIABLE _rc)
        if (NOT _rc EQUAL 0 OR NOT EXISTS "${_sdist_tgz}")
            message(FATAL_ERROR "pykvcache: could not download the llama-cpp-python ${PYKVCACHE_LLAMA_CPP_PYTHON_VERSION} sdist. "
                                "On a machine without PyPI, set LLAMA_CPP_SOURCE_DIR to a pristine llama.cpp tree: "
                                "${_version_hint}.")
        endif()
        file(SHA256 "${_sdist_tgz}" _sha)
        if (NOT _sha STREQUAL PYKVCACHE_LLAMA_CPP_PYTHON_SHA256)
            file(REMOVE "${_sdist_tgz}")
            message(FATAL_ERROR "pykvcache: the downloaded llama-cpp-python sdist has sha256 ${_sha}, not "
                                "${PYKVCACHE_LLAMA_CPP_PYTHON_SHA256}; it was removed, run the build again")
        endif()
    endif()
    # unpacked in full, or unpacked again: the tree takes its name only once the archive is out whole
    if (NOT EXISTS "${_sdist_dir}/${_sdist_name}/.pykvcache-unpacked")
        message(STATUS "pykvcache: unpacking ${_sdist_tgz}")
        file(REMOVE_RECURSE "${_sdist_dir}/${_sdist_name}" "${_sdist_dir}/.unpacking")
        file(ARCHIVE_EXTRACT INPUT "${_sdist_tgz}" DESTINATION "${_sdist_dir}/.unpacking")
        if (NOT EXISTS "${_sdist_dir}/.unpacking/${_sdist_name}/vendor/llama.cpp/src/llama-context.cpp")
            message(FATAL_ERROR "pykvcache: ${_sdist_tgz} did not unpack to a llama.cpp tree; delete it and run the build again")
        endif()
        file(RENAME "${_sdist_dir}/.unpacking/${_sdist_name}" "${_sdist_dir}/${_sdist_name}")
        file(REMOVE_RECURSE "${_sdist_dir}/.unpacking")
        file(TOUCH "${_sdist_dir}/${_sdist_name}/.pykvcache-unpacked")
    endif()
endif()

# the patch series, in order
file(GLOB _patches LIST_DIRECTORIES false "${PYKVCACHE_PATCH_DIR}/*.patch")
list(SORT _patches)
# a changed, added or removed patch (the folder's time) configures again, and so patches again, at the next build
# (not in cmake -P script mode, which has no build)
if (NOT CMAKE_SCRIPT_MODE_FILE)
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${PYKVCACHE_PATCH_DIR}" ${_patches})
endif()

set(_hash_input "")
set(_touched "")
foreach (_p IN LISTS _patches)
    file(READ "${_p}" _content)
    string(APPEND _hash_input "${_content}")
    # files touched by the patch: "+++ b/path" lines
    string(REGEX MATCHALL "\n\\+\\+\\+ b/[^\n\t]+" _lines "\n${_content}")
    foreach (_l IN LISTS _lines)
        string(REGEX REPLACE "^\n\\+\\+\\+ b/" "" _f "${_l}")
        list(APPEND _touched "${_f}")
    endforeach()
endforeach()
list(REMOVE_DUPLICATES _touched)
string(MD5 _series_hash "${_hash_input}")

set(_stamp "${_patched}/.pykvcache-patches")
set(_old_hash "")
set(_old_touched "")
if (EXISTS "${_stamp}")
    file(STRINGS "${_stamp}" _stamp_lines)
    list(POP_FRONT _stamp_lines _old_hash)
    set(_old_touched ${_stamp_lines})
endif()

if (NOT _old_hash STREQUAL _series_hash)
    if (NOT EXISTS "${_stamp}")
        # no stamp: a first copy, one that was cut short, or one whose series failed to apply (the pristine tree may
        # have changed since): copied afresh, whole, into a folder that takes its name once complete
        message(STATUS "pykvcache: copying llama.cpp into ${_patched}")
        file(REMOVE_RECURSE "${_patched}" "${_patched}.copying")
        file(MAKE_DIRECTORY "${_patched}.copying")
        foreach (_item CMakeLists.txt LICENSE cmake ggml src include common vendor licenses tests)
            if (EXISTS "${_pristine}/${_item}")
                file(COPY "${_pristine}/${_item}" DESTINATION "${_patched}.copying")
            endif()
        endforeach()
        file(RENAME "${_patched}.copying" "${_patched}")
    else()
        # restore every file that the old or the new series touches, so the new series applies to pristine files
        set(_restore ${_old_touched} ${_touched})
        list(REMOVE_DUPLICATES _restore)
        foreach (_f IN LISTS _restore)
            if (EXISTS "${_pristine}/${_f}")
                configure_file("${_pristine}/${_f}" "${_patched}/${_f}" COPYONLY)
            else()
                file(REMOVE "${_patched}/${_f}")
            endif()
        endforeach()
    endif()

    find_program(PYKVCACHE_PATCH_EXE patch REQUIRED)
    foreach (_p IN LISTS _patches)
        get_filename_component(_pname "${_p}" NAME)
        execute_process(
            COMMAND ${PYKVCACHE_PATCH_EXE} -p1 --forward --batch --silent --no-backup-if-mismatch -r - -i "${_p}"
            WORKING_DIRECTORY "${_patched}"
            RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
        if (NOT _rc EQUAL 0)
            file(REMOVE "${_stamp}")
            message(FATAL_ERROR "pykvcache: patch ${_pname} does not apply to ${_pristine}, which must be "
                                "${_version_hint}:\n${_out}${_err}")
        endif()
        message(STATUS "pykvcache: applied ${_pname}")
    endforeach()

    string(REPLACE ";" "\n" _touched_lines "${_touched}")
    file(WRITE "${_stamp}" "${_series_hash}\n${_touched_lines}\n")
endif()

set(PYKVCACHE_LLAMA_DIR "${_patched}")
