# SPDX-License-Identifier: Apache-2.0
# cmake -DIN=file -DOUT=file.c -DSYM=name -P bin2c.cmake
# Writes `const unsigned char SYM[]` (16-byte aligned, as cuModuleLoadData and
# hipModuleLoadData want) and `const size_t SYM_size` holding IN's bytes.
file(READ ${IN} hex HEX)
string(LENGTH "${hex}" n2)
math(EXPR n "${n2} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "((0x..,){24})" "\\1\n" body "${body}")
file(WRITE ${OUT} "/* generated from ${IN} by bin2c.cmake */\n#include <stddef.h>\n"
     "__attribute__((aligned(16))) const unsigned char ${SYM}[${n}] = {\n${body}\n};\n"
     "const size_t ${SYM}_size = ${n};\n")
