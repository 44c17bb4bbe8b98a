# Tri-state feature options (AUTO / ON / OFF) with a found/not-found summary at configure.

set(_ZEROFLAT_FEATURES "" CACHE INTERNAL "")

# zeroflat_feature(NAME DOC): declares the cache option ZEROFLAT_WITH_<NAME>, default AUTO.
macro(zeroflat_feature name doc)
  set(ZEROFLAT_WITH_${name} AUTO CACHE STRING "${doc}: AUTO (on when found), ON or OFF")
  set_property(CACHE ZEROFLAT_WITH_${name} PROPERTY STRINGS AUTO ON OFF)
  string(TOUPPER "${ZEROFLAT_WITH_${name}}" ZEROFLAT_WITH_${name})
  if(ZEROFLAT_WITH_${name} MATCHES "^(1|TRUE|YES|Y)$")
    set(ZEROFLAT_WITH_${name} ON)
  elseif(ZEROFLAT_WITH_${name} MATCHES "^(0|FALSE|NO|N)$")
    set(ZEROFLAT_WITH_${name} OFF)
  endif()
  set(_ZEROFLAT_FEATURES "${_ZEROFLAT_FEATURES};${name}" CACHE INTERNAL "")
endmacro()

# zeroflat_feature_result(NAME FOUND WHAT): records the outcome; a feature forced ON whose
# dependency is missing stops the configure with what to install.
function(zeroflat_feature_result name found what)
  if(ZEROFLAT_WITH_${name} STREQUAL "OFF")
    set(_state "off (ZEROFLAT_WITH_${name}=OFF)")
  elseif(found)
    set(_state "ON  (found ${what})")
  elseif(ZEROFLAT_WITH_${name} STREQUAL "ON")
    message(FATAL_ERROR "ZEROFLAT_WITH_${name}=ON but ${what} was not found")
  else()
    set(_state "off (not found: ${what})")
  endif()
  set(_ZEROFLAT_STATE_${name} "${_state}" CACHE INTERNAL "")
endfunction()

function(zeroflat_feature_summary)
  message(STATUS "zeroflat ${PROJECT_VERSION} optional backends:")
  foreach(name IN LISTS _ZEROFLAT_FEATURES)
    if(name)
      message(STATUS "  ${name}: ${_ZEROFLAT_STATE_${name}}")
    endif()
  endforeach()
endfunction()
