# SPDX-License-Identifier: Apache-2.0
# page.cmake — builds one man page: the handwritten scdoc source with its @GENERATED@ line
# replaced by what GENERATOR prints (tallyd's options or keys from its table of settings,
# tally's options and commands from its option tables), rendered by scdoc.
#
#   cmake -DSCDOC=scdoc -DSOURCE=tallyd.8.scd -DGENERATOR=tallyd -DGENERATOR_ARG=--print-options-scd
#         -DOUTPUT=tallyd.8 -P page.cmake
#
# The assembled source is kept beside OUTPUT (OUTPUT.scd) for reading. A generator that fails,
# a source without exactly one @GENERATED@ line, or scdoc refusing the page fails the build.
foreach(var SCDOC SOURCE GENERATOR GENERATOR_ARG OUTPUT)
  if(NOT ${var})
    message(FATAL_ERROR "page.cmake: ${var} is not set")
  endif()
endforeach()

# An ASan build's binaries run here too: what they leak at exit is no concern of the page.
set(ENV{ASAN_OPTIONS} "detect_leaks=0")
execute_process(COMMAND ${GENERATOR} ${GENERATOR_ARG} OUTPUT_VARIABLE generated
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR generated STREQUAL "")
  message(FATAL_ERROR "page.cmake: ${GENERATOR} ${GENERATOR_ARG} failed (${rc}): ${err}")
endif()

file(READ "${SOURCE}" page)
string(REGEX MATCHALL "\n@GENERATED@\n" markers "${page}")
list(LENGTH markers count)
if(NOT count EQUAL 1)
  message(FATAL_ERROR "page.cmake: ${SOURCE} needs exactly one @GENERATED@ line (has ${count})")
endif()
string(REPLACE "\n@GENERATED@\n" "\n${generated}\n" page "${page}")
file(WRITE "${OUTPUT}.scd" "${page}")

execute_process(COMMAND ${SCDOC} INPUT_FILE "${OUTPUT}.scd" OUTPUT_FILE "${OUTPUT}.tmp"
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "page.cmake: scdoc refused ${OUTPUT}.scd: ${err}")
endif()
file(RENAME "${OUTPUT}.tmp" "${OUTPUT}")
